"""benchmark/: every entry point on tiny budgets (real torchrun runs, real gloo groups), no timing asserts."""

import os
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmark import common, grad_sync, plot, run, scaling
from tests.helpers import ROOT, read_scalars

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def table_rows(markdown: str, first_header: str) -> list[list[str]]:
    """The body rows of the markdown table whose first header is `first_header`."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5_000, path


@pytest.mark.parametrize("module", [run, plot, scaling, grad_sync])
def test_every_entry_point_has_help(module, capsys):
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_results_header_names_command_machine_and_torch_and_sets_the_notes_apart_as_prose():
    argv = ["--a", "1", "--notes", "first note", "second note", "--b", "x y", "--notes=third", "--", "--notes", "z"]
    header = common.results_header("T", "benchmark.x", argv, ["a fact"], ["first note", "second note"])
    lines = header.splitlines()
    assert lines[:3] == [
        "# T",
        "",
        "- command: `python -m benchmark.x --a 1 --b 'x y' -- --notes z` (from the repository root)",
    ]
    assert header.endswith("\n- a fact\n\nfirst note\n\nsecond note\n")  # the notes: paragraphs after the list
    assert header.count("first note") == 1
    assert common.cpu_model() in header and torch.__version__ in header
    assert re.search(r"- checkout: commit [0-9a-f]{7}", header)
    cores = len(os.sched_getaffinity(0))
    assert f"{cores} usable cores" in header
    if Path("/proc/cpuinfo").exists():
        assert common.cpu_model() in Path("/proc/cpuinfo").read_text()


def test_dry_run_prints_the_exact_torchrun_commands(tmp_path, capsys):
    out_dir = tmp_path / "bench"
    argv = ["--script", "vpg_mpi.py", "--env-ids", "CartPole-v1", "Pendulum-v1", "--out-dir", str(out_dir)]
    assert run.main([*argv, "--dry-run", "--", "--total-timesteps", "400"]) == 0
    printed = capsys.readouterr().out.splitlines()
    expected = [
        f"(cd {out_dir} && "
        + shlex.join(
            [
                sys.executable,
                *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "vpg_mpi.py")),
                *("--env-id", env_id, "--seed", str(seed), "--run-name", f"vpg_mpi__{env_id}__{seed}"),
                *("--total-timesteps", "400"),
            ]
        )
        + ")"
        for env_id in ("CartPole-v1", "Pendulum-v1")
        for seed in (1, 2, 3)
    ]
    assert printed == expected
    assert not out_dir.exists()


def test_run_two_seeds_in_parallel_then_plot_them(tmp_path, capsys):
    out_dir = tmp_path / "bench"
    argv = ["--script", "vpg_mpi.py", "--env-ids", "CartPole-v1", "--seeds", "1", "2", "--parallel", "2"]
    failed = run.main([*argv, "--out-dir", str(out_dir), "--", "--steps-per-epoch", "200", "--total-timesteps", "400"])
    output = capsys.readouterr().out
    assert failed == 0, output
    run_dirs = sorted((out_dir / "runs").iterdir())
    assert [path.name for path in run_dirs] == ["vpg_mpi__CartPole-v1__1", "vpg_mpi__CartPole-v1__2"]
    finals = []
    for run_dir in run_dirs:
        scalars = read_scalars(run_dir)
        assert [step for step, _ in scalars["charts/SPS"]] == [200, 400]  # two iterations each
        finals.append(np.mean([value for _, value in scalars["charts/episodic_return"]][-2:]))
        assert f"[{run_dirs.index(run_dir) + 1}/2] {run_dir.name}: 100% epoch 2/2 step 400" in output
        assert "epoch 2/2" in (out_dir / "logs" / f"{run_dir.name}.log").read_text()
    # the seeds really differ, and a second launch refuses to mix new runs into old folders
    assert read_scalars(run_dirs[0])["charts/episodic_return"] != read_scalars(run_dirs[1])["charts/episodic_return"]
    with pytest.raises(SystemExit, match="--overwrite"):
        run.main([*argv, "--out-dir", str(out_dir)])

    stem = tmp_path / "results" / "curves"
    argv = [str(out_dir / "runs"), "--out", str(stem), "--last-points", "2", "--reference", "CartPole-v1=500 (ref)"]
    table_path, png_path = plot.main([*argv, "--notes", "two seeds, to test"])
    assert_png(png_path)
    text = table_path.read_text()
    assert f"- command: `{shlex.join(['python', '-m', 'benchmark.plot', *argv])}`" in text
    assert "\n\ntwo seeds, to test\n\n![learning curves](curves.png)" in text
    [[env_id, cell, reference]] = table_rows(text, "env")
    assert (env_id, reference) == ("CartPole-v1", "500 (ref)")
    assert cell == f"{np.mean(finals):.2f} +- {np.std(finals):.2f} (2 seeds, 400 steps)"


def test_plot_curves_and_final_returns_on_synthetic_runs():
    steps = np.arange(1, 11) * 100.0
    runs = [
        plot.Run(Path("a"), "E", "1", "x", steps, np.arange(10.0)),
        plot.Run(Path("b"), "E", "2", "x", steps, np.arange(10.0) + 2),
    ]
    assert plot.final_return(runs[0], 3) == pytest.approx(8.0)
    assert plot.trailing_mean(np.array([1.0, 3.0, 5.0, 7.0]), 2).tolist() == [1.0, 2.0, 4.0, 6.0]
    grid, mean, std = plot.mean_curve(runs, smooth=1, points=10)
    assert grid.tolist() == steps.tolist()
    assert mean.tolist() == pytest.approx((np.arange(10.0) + 1).tolist()) and std == pytest.approx(1.0)
    [[_, cell]] = table_rows(plot.summarize(runs, 3, {}, "ref"), "env")
    assert cell == "9.00 +- 1.00 (2 seeds, 1,000 steps)"


def test_scaling_one_and_two_ranks(tmp_path):
    work = tmp_path / "work"
    argv = ["--scripts", "vpg_mpi.py", "--ranks", "1", "2", "--iterations", "3", "--local-steps", "100"]
    argv += ["--env-id", "CartPole-v1", "--out", str(tmp_path / "scaling"), "--out-dir", str(work)]
    table_path, png_path = scaling.main([*argv, "--max-load", "1000"])
    assert_png(png_path)
    text = table_path.read_text()
    assert "MEASURED UNDER LOAD" not in text
    assert "## vpg_mpi.py on CartPole-v1" in text and "546 -> 1040" in text
    rows = table_rows(text, "ranks")
    assert [row[:2] for row in rows] == [["1", "100"], ["2", "200"]]
    sps = []
    for ranks, row in zip((1, 2), rows, strict=True):
        events = common.read_scalar_events(work / "runs" / f"scaling__vpg_mpi__{ranks}ranks")
        steps = [step for _, step, _ in events["charts/SPS"]]
        assert steps == [100 * ranks * i for i in (1, 2, 3)]  # three iterations of 100 steps per rank
        (wall_1, step_1, _), (wall_3, step_3, _) = events["charts/SPS"][0], events["charts/SPS"][-1]
        sps.append((step_3 - step_1) / (wall_3 - wall_1))
        assert row[2] == f"{sps[-1]:,.0f}"
        assert row[6] == f"{np.median([value for _, _, value in events['perf/rollout_time']][1:]):.3f}"
        assert float(row[8]) <= float(row[7])  # sync is part of the update
    assert rows[0][4:6] == ["1.00", "100%"]
    assert rows[1][4:6] == [f"{sps[1] / sps[0]:.2f}", f"{sps[1] / sps[0] / 2:.0%}"]


def test_grad_sync_table_with_few_repetitions(tmp_path):
    argv = ["--nprocs", "2", "--repeats", "2", "--warmup", "1", "--cnn-batch", "4", "--mlp-batch", "8"]
    table_path = grad_sync.main([*argv, "--out", str(tmp_path / "grad_sync"), "--max-load", "-1"])
    text = table_path.read_text()
    assert text.splitlines()[2].startswith("**MEASURED UNDER LOAD")  # above the load limit: said at the top
    rows = table_rows(text, "model")
    methods = {(row[0].split(".")[0], row[2]) for row in rows}
    expected = {("vpg_mpi", "gather+broadcast")}
    expected |= {
        (model, method)
        for model in ("vpg_mpi", "ppo_continuous_mpi", "ppo_atari_multigpu")
        for method in ("per-parameter", "flat", "DDP")
    }
    assert methods == expected and len(rows) == len(expected)
    for row in rows:
        assert row[7] == "yes", row  # every method averaged (or gathered and broadcast) correctly
        assert re.fullmatch(r"-?\d+\.\d+( \(\d+\.\d+-\d+\.\d+\))?", row[3]), row
        assert float(row[6]) == pytest.approx(float(row[4]) * int(row[5]), abs=0.1 * int(row[5])), row  # mean x syncs
    assert "1,686,693 in 12 tensors" in text  # the Nature CNN, built by ppo_atari_multigpu.Agent
