"""Training batches from a Parquet folder: passes over files shorter than the run, and files of another preset."""

import dataclasses
import warnings

import pytest

from opengem.data.parquet import synthesize_to_parquet
from opengem.train.config import PRESETS
from opengem.train.data_stream import train_batches


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny40")
    synthesize_to_parquet(out, 40, "gem-tiny", seed=3, rows_per_file=40, row_group_size=40, progress=False)
    return out


def _config(data_dir, **changes):
    return dataclasses.replace(PRESETS["gem-tiny"], data_dir=str(data_dir), batch_size=16, num_workers=0, **changes)


def _ids(batch):
    return batch.sample_id.tolist()


def test_a_run_longer_than_its_files_reads_them_again_and_says_so(tiny_dir):
    stream = train_batches(_config(tiny_dir), start_step=0)
    first_pass = [next(stream) for _ in range(3)]
    assert [b.batch_size() for b in first_pass] == [16, 16, 8]  # 40 rows: the last batch is partial
    with pytest.warns(UserWarning, match=r"pass 1 ended after 3 batches \(rank 0\); reading the files again as pass 2"):
        second = next(stream)
    assert _ids(second) == _ids(first_pass[0])  # one process, no shuffling: the same order again
    assert _ids(next(stream)) == _ids(first_pass[1])


def test_a_resume_past_the_first_pass_continues_where_the_run_was(tiny_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the new pass's warning, tested above
        uninterrupted = train_batches(_config(tiny_dir), start_step=0)
        expected = [_ids(next(uninterrupted)) for _ in range(7)][4:]
        resumed = train_batches(_config(tiny_dir), start_step=4)
        assert [_ids(next(resumed)) for _ in range(3)] == expected


def test_files_of_another_data_preset_are_refused_with_the_fix(tiny_dir):
    with pytest.raises(ValueError, match=r"does not hold data_preset 'gem-small'.*feature 'user_id' is categorical "
                                         r"with \d+ ids there and categorical with \d+ in the preset.*"
                                         r"set data_preset=gem-tiny"):
        train_batches(_config(tiny_dir, data_preset="gem-small"), start_step=0)
