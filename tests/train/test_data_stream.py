"""Training batches from a Parquet folder: passes over files shorter than the run, and files of another preset; the
held-out set from an eval_dir, or from the training files' own synthetic world."""

import dataclasses
import json
import warnings

import pyarrow.parquet as pq
import pytest
import torch

from opengem.data.parquet import batches_from_table, synthesize_to_parquet
from opengem.data.synthetic import HOLDOUT_START, SYNTHETIC_PRESETS, generate
from opengem.train.config import PRESETS
from opengem.train.data_stream import eval_batches, holdout_seed, in_sample_order, train_batches


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


# ------------------------------------------------------------------------------------------- the held-out set


@pytest.fixture(scope="module")
def holdout_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("holdout")
    synthesize_to_parquet(out, 50, "gem-tiny", seed=3, rows_per_file=20, row_group_size=10, progress=False,
                          first_sample=HOLDOUT_START)
    return out


def test_the_held_out_set_of_a_data_dir_comes_from_the_world_its_files_were_written_in(tiny_dir):
    # tiny_dir was written with seed 3; the run's seed is 0: the held-out samples are those of seed 3's world
    batches = eval_batches(_config(tiny_dir, seed=0, eval_samples=40))
    expected = batches_from_table(generate(SYNTHETIC_PRESETS["gem-tiny"], 40, 3, start=HOLDOUT_START), 16)
    for got, want in zip(batches, expected, strict=True):
        assert torch.equal(got.sample_id, want.sample_id) and torch.equal(got.labels, want.labels)
        assert torch.equal(got.oracle, want.oracle)
    assert holdout_seed(_config(tiny_dir, seed=0)) == 3 and holdout_seed(_config("", seed=7)) == 7


def test_files_that_record_no_generator_seed_need_an_eval_dir(tmp_path, tiny_dir):
    table = pq.read_table(next(tiny_dir.glob("*.parquet")))
    metadata = dict(table.schema.metadata)
    key = next(k for k in metadata if b"opengem" in k)
    described = json.loads(metadata[key])
    described["source"] = {}  # files another tool wrote in the same layout
    pq.write_table(table.replace_schema_metadata({**metadata, key: json.dumps(described).encode()}),
                   tmp_path / "part-00000.parquet")
    with pytest.raises(ValueError, match=r"record no generator seed .* set eval_dir"):
        eval_batches(_config(tmp_path))


def test_an_eval_dir_gives_its_first_eval_samples_rows_in_file_order(tiny_dir, holdout_dir):
    batches = eval_batches(_config(tiny_dir, eval_dir=str(holdout_dir), eval_samples=35))
    assert [b.batch_size() for b in batches] == [16, 16, 3]
    assert torch.cat([b.sample_id for b in batches]).tolist() == list(range(HOLDOUT_START, HOLDOUT_START + 35))
    # data parallel: each rank its slice of every batch, together the one-process set
    halves = [eval_batches(_config(tiny_dir, eval_dir=str(holdout_dir), eval_samples=35), rank, 2) for rank in (0, 1)]
    merged = [torch.cat([a.sample_id, b.sample_id]) for a, b in zip(*halves, strict=True)]
    assert [m.tolist() for m in merged] == [b.sample_id.tolist() for b in batches]


def test_an_eval_dir_smaller_than_eval_samples_is_used_whole_with_a_warning(holdout_dir):
    with pytest.warns(UserWarning, match=r"holds 50 samples, fewer than eval_samples=20000: evaluating on all 50"):
        batches = eval_batches(_config("", eval_dir=str(holdout_dir), eval_samples=20000))
    assert sum(b.batch_size() for b in batches) == 50


def test_bad_eval_dirs_are_refused_by_name(tmp_path, tiny_dir, holdout_dir):
    with pytest.raises(ValueError, match=r"eval_dir .* is data_dir: the held-out set would be training samples"):
        eval_batches(_config(tiny_dir, eval_dir=str(tiny_dir) + "/"))
    with pytest.raises(ValueError, match=r"eval_dir .* does not hold data_preset 'gem-small'"):
        eval_batches(_config("", eval_dir=str(holdout_dir), data_preset="gem-small"))
    with pytest.raises(FileNotFoundError, match="no \\*.parquet files"):
        eval_batches(_config("", eval_dir=str(tmp_path)))


def test_ranks_held_out_pieces_go_back_in_sample_order_whatever_the_set_size(holdout_dir):
    config = _config("", eval_dir=str(holdout_dir), eval_samples=20000)  # batches of 16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 50 samples, fewer than eval_samples: tested above
        whole = torch.cat([b.sample_id for b in eval_batches(config)])
        parts = [torch.cat([b.sample_id for b in eval_batches(config, rank, 3)]) for rank in range(3)]
    assert whole.numel() == 50 and torch.equal(in_sample_order(parts, 16), whole)
    with pytest.raises(ValueError, match="the held-out set has 2 samples, fewer than the 3 ranks"):
        eval_batches(dataclasses.replace(config, eval_dir="", eval_samples=2), 0, 3)
