"""The GPU session script (benchmarks/next_gpu_session.sh) dispatches every one-GPU part, run here with a stand-in
``python`` that records its command line: a part that names a function the steps cannot see (not exported to
their ``bash -c``) or a misspelt chain fails with rc 127 in a device call, at the cost of the call."""

import re
import stat
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "next_gpu_session.sh"
FAKE_PYTHON = """
echo "cpp_wrapper=${TORCHINDUCTOR_CPP_WRAPPER:-0} tuning=${OPENGEM_GDPA_TUNE:-on} python $*" >> "$RECORD"
echo "python $*"
"""


def one_gpu_parts() -> list[str]:
    """The script's one-GPU parts: each ``chain_NAME`` function is part ``NAME``."""
    return re.findall(r"^chain_(\w+)\(\)", SCRIPT.read_text(), flags=re.MULTILINE)


def run_script(part: str, out: Path, tmp_path: Path, python_body: str, **env: str) -> Path:
    """The script's ``part`` into ``out``, from ``tmp_path/checkout`` (a checkout of its own: the script unpacks a
    carried .compile_cache.tgz and packs .compile_cache/ where it runs), with a stand-in ``python`` that reports one
    GPU and otherwise runs the bash ``python_body``; ``env`` is added to the steps' environment. Returns the
    checkout."""
    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    python = shim / "python"
    python.write_text('#!/bin/bash\nif [ "$1" = "-c" ]; then echo 1; exit 0; fi  # one GPU\n' + python_body)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    checkout = tmp_path / "checkout"
    (checkout / "benchmarks" / "results").mkdir(parents=True, exist_ok=True)
    subprocess.run(["bash", str(SCRIPT), str(out), part], cwd=checkout, check=True, timeout=120, capture_output=True,
                   env={"PATH": f"{shim}:/usr/bin:/bin", "OPENGEM_GIT_COMMIT": "test", "HOME": str(tmp_path), **env})
    return checkout


def run_part(part: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    """The part's status lines and the command lines its steps gave ``python``."""
    record = tmp_path / f"{part}.commands"
    out = tmp_path / part
    run_script(part, out, tmp_path, FAKE_PYTHON, RECORD=str(record))
    status = (out / "status").read_text().splitlines()
    return status, record.read_text().splitlines() if record.exists() else []


def test_every_one_gpu_part_dispatches_and_each_step_runs(tmp_path):
    parts = one_gpu_parts()
    assert {"s13c", "s13d", "s15a", "s15b", "s15c"} <= set(parts)
    for part in parts:
        status, commands = run_part(part, tmp_path)
        assert status and all(line.startswith("rc=0 ") for line in status), (part, status)
        assert len(commands) >= len(status), (part, commands)  # every step reached python


def test_an_unknown_part_stops_before_any_step(tmp_path):
    """A part with no ``chain_`` function of its name exits 2 and names itself, running nothing."""
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), "s99z"], cwd=tmp_path, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "OPENGEM_GIT_COMMIT": "test", "HOME": str(tmp_path)},
                            capture_output=True, text=True)
    assert result.returncode == 2 and "unknown part s99z" in result.stderr
    assert not (tmp_path / "out" / "status").exists() or not (tmp_path / "out" / "status").read_text().strip()


@pytest.mark.parametrize(("part", "expected"), [
    ("s15a", [r"tuning=on python -m pytest .* tests/gpu/test_low_precision_gpu.py",
              r"tuning=on python -m benchmarks\.low_precision$", r"python -m benchmarks\.diag\.fp8_mlp_kernels$"]),
    ("s15c", [(r"tuning=0 python -m benchmarks\.low_precision_curves --variant none --label bf16_sequence "
               r"--set gem\.sequence_dtype=compute"), r"tuning=0 python .* --compare --label bf16_sequence"]),
    ("s13c", [r"tuning=0 python .* --variant fp8_rowwise$", r"tuning=0 python .* --compare --variant fp8_rowwise"]),
    ("s20b", [r"tuning=0 python .* --variant none --label bf16_repeat --checkpoint-dir runs/curve_bf16_repeat --resume$",
              r"tuning=0 python .* --compare --variant none --label bf16_repeat --bar 0\.003$",
              (r"tuning=0 python .* --compare --variant fp8_rowwise --label fp8_attention_straight_through "
               r"--baseline bf16_repeat --bar 0\.003$")]),
    ("s69b", [r"tuning=0 python .* --variant none --label shadow_default --checkpoint-dir runs/curve_shadow_default "
              r"--resume$",
              r"tuning=0 python .* --compare --variant none --label shadow_default --baseline bf16_repeat "
              r"--bar 0\.003$",
              r"tuning=0 python .* --compare --variant none --label narrow_state --baseline shadow_default "
              r"--bar 0\.003$"]),
])
def test_next_session_parts_run_their_commands_with_the_tuning_switches(part, expected, tmp_path):
    """The curves run with the kernels' tuning off (both runs of a comparison alike), the benchmarks tuned."""
    _, commands = run_part(part, tmp_path)
    assert len(commands) == len(expected)
    for command, pattern in zip(commands, expected):
        assert re.search(pattern, command), (command, pattern)


def test_the_cpp_wrapper_chains_pass_the_setting_to_their_steps_only(tmp_path):
    """``s60c`` runs bench train and ``s60d`` the --gil samples with ``compile_cpp_wrapper=true`` (``s60f`` both,
    samples first), the setting users get rather than Inductor's global switch; py-spy's install runs without it."""
    _, commands = run_part("s60c", tmp_path)
    bench = (r"^cpp_wrapper=0 .* -m opengem\.cli\.main bench train --preset gem-large --batch-size 256 .*"
             r"--set compile_cpp_wrapper=true --out ")
    assert len(commands) == 1 and re.search(bench, commands[0]), commands
    _, commands = run_part("s60d", tmp_path)
    assert len(commands) == 2, commands
    assert re.search(r"^cpp_wrapper=0 .* -m pip install .*py_spy", commands[0]), commands[0]
    assert "compile_cpp_wrapper" not in commands[0], commands[0]
    samples = (r"^cpp_wrapper=0 .* -m benchmarks\.diag\.host_samples --preset gem-large .* "
               r"--gil --set compile_cpp_wrapper=true$")
    assert re.search(samples, commands[1]), commands[1]
    _, commands = run_part("s60f", tmp_path)  # both in one call: the samples pay the cold compile, then the bench
    assert len(commands) == 3, commands
    assert re.search(samples, commands[1]) and re.search(bench, commands[2]), commands


def test_a_call_returns_its_own_results_and_the_compile_cache(tmp_path):
    """Of the checkout's benchmarks/results only what the call wrote comes back (not every committed file), and
    the compile caches the steps filled come back as compile_cache.tgz in 13.9 MB pieces (a returned file's limit
    is 16 MiB), to join and carry into a fresh machine."""
    import os
    import tarfile

    root = tmp_path / "checkout"
    (root / "benchmarks" / "results").mkdir(parents=True)
    committed = root / "benchmarks" / "results" / "committed.json"
    committed.write_text("{}")
    os.utime(committed, (0, 0))
    out = tmp_path / "out"
    run_script("s17d", out, tmp_path, 'echo "{}" > benchmarks/results/written.json\n'
               'mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && echo graph > "$TORCHINDUCTOR_CACHE_DIR/entry"\n'
               'head -c 16000000 /dev/urandom > "$TORCHINDUCTOR_CACHE_DIR/kernels.bin"\n')
    with tarfile.open(out / "results.tgz") as results:
        names = {Path(name).name for name in results.getnames()}
    assert "written.json" in names and "committed.json" not in names
    pieces = sorted(out.glob("compile_cache.tgz.part*"))
    assert [p.name for p in pieces] == ["compile_cache.tgz.part0", "compile_cache.tgz.part1"]
    assert all(p.stat().st_size <= 13_900_000 for p in pieces)
    joined = tmp_path / "compile_cache.tgz"
    joined.write_bytes(b"".join(p.read_bytes() for p in pieces))
    with tarfile.open(joined) as cache:
        assert {"./inductor/entry", "./inductor/kernels.bin"} <= set(cache.getnames())
        assert cache.getmember("./inductor/kernels.bin").size == 16_000_000


def test_a_call_cut_short_keeps_the_checkout_results_its_finished_steps_wrote(tmp_path):
    """``results.tgz`` is rewritten after every step with what the benchmarks wrote into the checkout so far: in
    ``s67a`` the optimizer benchmark's JSON is there when the next step starts (session 64 lost it to a call cut at
    600 s, when it was collected only at the end), a step's own file of that name is not overwritten, and a file
    rewritten by a later step comes back as last written."""
    import tarfile

    out = tmp_path / "out"
    record = tmp_path / "record"
    run_script("s67a", out, tmp_path,
               'if [ "$2" = benchmarks.optimizer ]; then echo first > benchmarks/results/optimizer_gem-large.json; fi\n'
               'if [ "$2" = opengem.cli.main ]; then\n'
               '  [ -e "$RECORD" ] || tar tzf "$FINAL/results.tgz" > "$RECORD"  # as the first such step starts\n'
               '  echo own > "$FINAL/work/results/train_gem-large_b256_s67a_default_a1.json"\n'
               '  echo checkout > benchmarks/results/train_gem-large_b256_s67a_default_a1.json\n'
               '  echo second > benchmarks/results/optimizer_gem-large.json\n'
               'fi\n', FINAL=str(out), RECORD=str(record))
    listing_before_the_third_step = record.read_text().splitlines()
    assert "results/optimizer_gem-large.json" in listing_before_the_third_step, listing_before_the_third_step
    with tarfile.open(out / "results.tgz") as results:
        read = {Path(name).name: results.extractfile(name).read().decode().strip()
                for name in results.getnames() if name.startswith("results/") and name.endswith(".json")}
    assert read["optimizer_gem-large.json"] == "second"
    assert read["train_gem-large_b256_s67a_default_a1.json"] == "own"


@pytest.mark.parametrize("part", ["s46c", "s47a", "s47b", "s47ab", "s47c"])
def test_the_gluon_chains_name_only_variants_their_diags_know(part, tmp_path):
    """A misspelt ``--variants`` name stops the Gluon diag at its start (``SystemExit``), at the cost of a device
    call; each chain's steps run the diags, and every variant they name exists."""
    from benchmarks.diag import gluon_gdpa_dkdv_kernels, gluon_gdpa_forward_kernels

    known = {"gluon_gdpa_dkdv": {v.name for v in gluon_gdpa_dkdv_kernels.VARIANTS},
             "gluon_gdpa_forward": {v.name for v in gluon_gdpa_forward_kernels.VARIANTS}}
    _, commands = run_part(part, tmp_path)
    diags = [re.search(r"-m benchmarks\.diag\.(gluon_\w+)", command) for command in commands]
    assert commands and all(diags), commands
    for command, diag in zip(commands, diags):
        named = re.search(r"--variants (\S+)", command)
        if named:
            assert set(named.group(1).split(",")) <= known[diag.group(1)], command
