"""benchmark/: every entry point on tiny budgets (real torchrun runs, real gloo groups), no timing asserts."""

import os
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmark import (
    atari_step,
    common,
    grad_sync,
    interval,
    plot,
    run,
    scaling,
    scaling_model,
    startup,
    stragglers,
    weight_check,
)
from tests.helpers import ROOT, read_scalars, run_command

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5_000, path


@pytest.mark.parametrize(
    "module", [run, plot, interval, scaling, scaling_model, grad_sync, stragglers, atari_step, weight_check, startup]
)
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


def test_dry_run_prints_the_exact_commands_each_launching_through_the_scripts_nprocs(tmp_path, capsys):
    out_dir = tmp_path / "bench"
    argv = ["--script", "vpg_mpi.py", "--env-ids", "CartPole-v1", "Pendulum-v1", "--out-dir", str(out_dir)]
    assert run.main([*argv, "--dry-run", "--", "--total-timesteps", "400"]) == 0
    printed = capsys.readouterr().out.splitlines()
    expected = [
        f"(cd {out_dir} && "
        + shlex.join(
            [
                *(sys.executable, str(ROOT / "vpg_mpi.py"), "--nprocs", "2"),
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
    # one rank each (the launch through --nprocs: the dry run above, and benchmark.scaling's runs below)
    argv = ["--script", "vpg_mpi.py", "--env-ids", "CartPole-v1", "--seeds", "1", "2", "--parallel", "2"]
    argv += ["--nprocs", "1"]
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
    [[env_id, cell, reference, reached]] = common.table_rows(text, "env")
    assert (env_id, reference, reached) == ("CartPole-v1", "500 (ref)", "not reached")
    low, high = sorted(finals)  # two seeds: the bootstrap's means run from one seed's value to the other's
    per_seed = ", ".join(f"{value:.2f} (seed {seed})" for seed, value in enumerate(finals, 1))
    spread = f"{np.mean(finals):.2f} +- {np.std(finals):.2f}, 95% CI [{low:.2f}, {high:.2f}]"
    assert cell == f"{spread} (2 seeds, 400 steps: {per_seed})"


def test_plot_curves_and_final_returns_on_synthetic_runs():
    steps = np.arange(1, 11) * 100.0
    runs = [
        plot.Run(Path("a"), "E", "1", "x", steps, np.arange(10.0), steps / 10),  # 10 steps per second
        plot.Run(Path("b"), "E", "2", "x", steps, np.arange(10.0) + 2, steps / 5),
    ]
    assert plot.final_return(runs[0], 3) == pytest.approx(8.0)
    assert plot.trailing_mean(np.array([1.0, 3.0, 5.0, 7.0]), 2).tolist() == [1.0, 2.0, 4.0, 6.0]
    grid, middle, low, high = plot.mean_curve(runs, smooth=1, points=10)
    assert grid.tolist() == steps.tolist()
    assert middle.tolist() == pytest.approx((np.arange(10.0) + 1).tolist())
    assert low.tolist() == np.arange(10.0).tolist() and high.tolist() == (np.arange(10.0) + 2).tolist()
    args = plot.Args(paths=(), last_points=3, smooth=1)
    [[_, cell]] = common.table_rows(plot.summarize(runs, args, {}), "env")
    assert cell == "9.00 +- 1.00, 95% CI [8.00, 10.00] (2 seeds, 1,000 steps: 8.00 (seed 1), 10.00 (seed 2))"
    # the mean curve 1, 2, ..., 10 reaches 6 at step 600 (602 on the plotted grid of 200 points from 100 to 1,000),
    # 60 s into one seed's run and 120 s into the other's
    for reference, reached in (("6 (ref)", "602 steps, 1:30"), ("20", "not reached"), ("~6 at 1k steps", "")):
        [[_, _, shown, time]] = common.table_rows(plot.summarize(runs, args, {"E": reference}), "env")
        assert (shown, time) == (reference, reached)


def test_bootstrap_interval_of_the_mean_and_from_five_seeds_of_the_iqm():
    # 3 seeds: all three draws of the lowest seed alone have probability 1/27 > 2.5%: the interval is their range
    assert plot.bootstrap_interval(np.array([3.0, 1.0, 2.0])) == (1.0, 3.0)
    values = np.array([4.0, 1.0, 3.0, 2.0])
    low, high = plot.bootstrap_interval(values)
    assert plot.center(values) == 2.5 and 1.0 < low < 2.5 < high < 4.0  # 4 seeds: narrower than their range
    # close to the exact bootstrap distribution's percentiles (all 256 draws of 4 seeds alike; its means step by 0.25)
    exact = values[np.stack(np.meshgrid(*[range(4)] * 4)).reshape(4, -1).T].mean(1)
    assert (low, high) == pytest.approx(tuple(np.quantile(exact, [0.025, 0.975])), abs=0.25)
    assert plot.bootstrap_interval(values) == (low, high)  # seeded: the same table every time
    assert np.isnan(plot.bootstrap_interval([5.0])).all()
    # from 5 seeds the IQM: a quarter cut from each end, so one wild seed moves it little, unlike the mean
    wild = np.array([1.0, 2.0, 3.0, 4.0, 100.0, 6.0, 7.0, 8.0])
    assert plot.center(wild) == np.mean([3.0, 4.0, 6.0, 7.0]) and plot.center(wild[:5]) == 3.0
    cell = plot.final_returns_cell({str(seed): value for seed, value in enumerate(wild, 1)}, "10")
    assert cell.startswith("IQM 5.00, 95% CI [") and "; 16.38 +- 31.69 (8 seeds, 10 steps: 1.00 (seed 1), 2.00" in cell
    low, high = plot.bootstrap_interval(wild)
    assert low < 5.0 < high < 50.0  # the mean's would reach far toward the wild seed
    # the same cell from per-seed values alone (results whose run folders are gone)
    assert interval.main([*map(str, wild), "--steps", "10"]) == cell
    with pytest.raises(SystemExit, match="as many --seeds as values"):
        interval.main(["1", "2", "--seeds", "7"])


def test_atari_step_splits_a_step_into_parts_beside_the_env_only_rate_and_each_scripts_own_run(tmp_path):
    """Tiny, on CPU: this checkout's acting step (acting_step) beside an older script's (a copy without it, acting as
    main once did inline), the parts adding up to the step, each script's own run beside its row."""
    old = tmp_path / "old" / common.ATARI
    old.parent.mkdir()
    old.write_text((ROOT / common.ATARI).read_text().replace("acting_step(", "acting_step_renamed("))
    work = tmp_path / "work"
    argv = ["--envs", "2", "3", "--steps", "4", "--env-seconds", "0.05", "--iterations", "2", "--num-steps", "8"]
    argv += [
        "--threads",
        "1",
        "--baseline",
        str(old),
        "--out",
        str(tmp_path / "step"),
        "--out-dir",
        str(work),
        "--max-load",
        "1000",
    ]
    text = atari_step.main([*argv, "--", "--num-minibatches", "2", "--update-epochs", "1"]).read_text()
    assert f"- baseline: {old} (sha256 " in text and "- this checkout: " in text and "threads: 1 (--threads)" in text
    rows, run_sps = common.table_rows(text, "configuration"), {}
    labels = ("baseline", "this checkout")
    assert [row[:3] for row in rows] == [[f"{n} envs", label, "cpu"] for n in (2, 3) for label in labels]
    for row in rows:
        parts = [float(cell.split()[0]) for cell in row[3:6]]
        shares = [int(cell.split("(")[1].rstrip("%)")) for cell in row[3:6]]
        assert float(row[6]) == pytest.approx(sum(parts), abs=0.003) and abs(sum(shares) - 100) <= 3
        num_envs, step_ms = int(row[0].split()[0]), float(row[7])
        assert float(row[8].replace(",", "")) == pytest.approx(num_envs / step_ms * 1e3, rel=0.01)
        assert row[9] == rows[rows.index(row) // 2 * 2][9]  # one env-only rate per env count
        run_dir = work / "runs" / f"atari_step__{row[1].split()[0]}__cpu__{num_envs}envs"
        measured = common.measure(run_dir, common.ATARI, "cpu", 1)
        hyperparameters = common.read_hyperparameters(run_dir)
        assert (hyperparameters["local_num_envs"], hyperparameters["torch_threads"]) == (str(num_envs), "1")
        run_sps[num_envs, row[1]] = measured.sps
        assert row[10] == f"{measured.sps:,.0f}" and row[12] == f"{measured.rollout / 8 * 1e3:.3f}"
        sps, env_only = (float(cell.replace(",", "")) for cell in (row[10], row[9]))
        assert float(row[11]) == pytest.approx(sps / env_only, abs=0.006)
    for n in (2, 3):  # one round: its ratio is the median
        ratio = f"{run_sps[n, 'this checkout'] / run_sps[n, 'baseline']:.3f}"
        assert f"- {n} envs, cpu: this checkout's SPS / the baseline's, each round: {ratio}; median {ratio}\n" in text
    # the older script acts through the inline step, this one through acting_step; both record what the Agent computes
    for path, acting in ((old, "inline"), (ROOT / common.ATARI, "acting_step")):
        module = common.load_script(path.name, path.parent)
        stepper = atari_step.Stepper(module, torch.device("cpu"), 2, 1, 4)
        assert stepper.acting == acting
        stepper.run(4, synced=True)
        stepper.close()
        batch = {key: value.flatten(0, 1) for key, value in stepper.storage.items()}
        module.check_rollout_policy(stepper.policy.agent, batch, "in the test", 8)  # exits unless they agree


def test_scaling_builds_pinned_one_thread_commands_for_every_script_and_mode():
    assert scaling.script_modes("vpg_mpi.py", ("allreduce", "gather")) == ["allreduce", "gather"]
    assert scaling.script_modes("ppo_continuous_mpi.py", ("gather",)) == ["gather"]
    assert scaling.script_modes("ppo_atari_multigpu.py", ("allreduce", "gather")) == ["DDP"]
    assert [scaling.rank_counts((), cores) for cores in (1, 2, 6, 8)] == [[1], [1, 2], [1, 2, 4, 6], [1, 2, 4, 8]]
    assert scaling.rank_counts((3,), 4) == [1, 3]
    with pytest.raises(SystemExit, match="between 1 and the 4 usable cores"):
        scaling.rank_counts((5,), 4)

    cores = [3, 5, 7]
    args = scaling.script_args("ppo_continuous_mpi.py", "gather", 1, 2048, 4)
    assert args == [
        *("--torch-threads", "1", "--sync", "gather", "--local-num-envs", "1", "--num-steps", "2048"),
        *("--total-timesteps", "8192"),
    ]
    script = ROOT / "ppo_continuous_mpi.py"
    assert common.script_command(script, args, 1, "torchrun", cores) == [
        *("taskset", "-c", "3", sys.executable, str(script), *args)
    ]
    args = scaling.script_args("ppo_atari_multigpu.py", "DDP", 2, 1024, 3)
    assert args == [
        *("--torch-threads", "1", "--env-threads", "1", "--local-num-envs", "8", "--num-steps", "128"),
        *("--total-timesteps", "6144"),
    ]
    # N ranks: the script's own --nprocs launch, each rank pinned as it starts by benchmark/pin_rank/sitecustomize.py
    pin_path = os.pathsep.join(filter(None, [str(ROOT / "benchmark" / "pin_rank"), os.environ.get("PYTHONPATH")]))
    pin = [f"PYTHONPATH={pin_path}"]
    for launcher, collectives in (("torchrun", "torch"), ("mpirun", "mpi")):
        assert common.script_command(ROOT / "ppo_atari_multigpu.py", args, 2, launcher, cores) == [
            *("taskset", "-c", "3,5", "env", *pin, "DDRL_PIN_CORES=3,5", sys.executable),
            *(str(ROOT / "ppo_atari_multigpu.py"), "--nprocs", "2", "--collectives", collectives, *args),
        ]
    args = scaling.script_args("vpg_mpi.py", "allreduce", 3, 100, 2)
    assert args[-4:] == ["--steps-per-epoch", "300", "--total-timesteps", "600"]  # SpinningUp's global batch
    # no local steps: each script's own default batch (VPG's at 1 rank), as benchmark.throughput runs them by default
    totals = {script: common.budget_args(script, 1, 0, 2)[-1] for script in common.SCRIPTS}
    assert totals == {"vpg_mpi.py": "8000", "ppo_continuous_mpi.py": "4096", "ppo_atari_multigpu.py": "2048"}
    with pytest.raises(ValueError, match="4 ranks but only 3 usable cores"):
        common.script_command(ROOT / "vpg_mpi.py", args, 4, "torchrun", cores)


def test_scaling_rounds_give_each_rounds_speedup_against_the_same_rounds_baseline():
    def measurement(ranks: int, sps: float) -> common.Measurement:
        return common.Measurement("vpg_mpi.py", "allreduce", ranks, 100 * ranks, 3, sps, sps, 1.0, 1.0, 0.1)

    rounds = {
        ("vpg_mpi.py", "allreduce", 1): [measurement(1, 100.0), measurement(1, 120.0), measurement(1, 80.0)],
        ("vpg_mpi.py", "allreduce", 2): [measurement(2, 190.0), measurement(2, 180.0), measurement(2, 168.0)],
    }
    assert scaling.round_speedups(rounds) == "- allreduce, 2 ranks: speedup per round 1.90, 1.50, 2.10; median 1.90\n"


def test_run_at_once_runs_its_commands_side_by_side_and_logs_each(tmp_path):
    # each command waits (at most 60 s) for the other's file: run one after the other, the first would time out
    wait = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); t = time.time() + 60\n"
    wait += "while not pathlib.Path(sys.argv[2]).exists() and time.time() < t: time.sleep(0.01)\n"
    wait += "print('saw', sys.argv[2], pathlib.Path(sys.argv[2]).exists()); sys.exit(int(sys.argv[3]))"
    commands = [[sys.executable, "-c", wait, "a", "b", "0"], [sys.executable, "-c", wait, "b", "a", "3"]]
    logs = [tmp_path / "logs" / "a.log", tmp_path / "logs" / "b.log"]
    assert common.run_at_once(commands, logs, tmp_path) == [0, 3]
    for log, other, command in zip(logs, "ba", commands, strict=True):
        assert log.read_text() == f"$ (cd {tmp_path} && {shlex.join(command)})\nsaw {other} True\n"


def test_pin_rank_pins_each_local_rank_to_its_core_as_python_starts_and_leaves_other_processes_alone(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    program = ["env", f"PYTHONPATH={ROOT / 'benchmark' / 'pin_rank'}", sys.executable, "-c"]
    program += ["import os, sys; print(sorted(os.sched_getaffinity(0)), sys.argv[1:])", "a", "b"]
    pin = {"DDRL_PIN_CORES": ",".join(map(str, cores))}
    for rank_variable in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"):  # torchrun's, mpirun's
        result = run_command(program, tmp_path, **pin, **{rank_variable: str(len(cores) - 1)})
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == [
            f"pin_rank: local rank {len(cores) - 1} on core {cores[-1]}",
            f"[{cores[-1]}] ['a', 'b']",
        ]
    result = run_command(program, tmp_path, **pin)  # no local rank: the re-launching script, torchrun's agent
    assert result.returncode == 0 and result.stdout.splitlines() == [f"{cores} ['a', 'b']"], result.stderr
    result = run_command(program, tmp_path, **pin, LOCAL_RANK="99")
    assert result.returncode == 1 and "local rank 99 but only cores" in result.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="2 ranks on 2 cores need 2 usable cores")
def test_scaling_two_ranks_on_two_cores_in_both_sync_modes_then_the_model(tmp_path):
    work = tmp_path / "work"
    argv = ["--scripts", "vpg_mpi.py", "--ranks", "2", "--iterations", "3", "--local-steps", "100"]
    argv += ["--env-id", "CartPole-v1", "--out", str(tmp_path / "scaling"), "--out-dir", str(work)]
    table_path, png_path = scaling.main([*argv, "--max-load", "1000"])
    assert_png(png_path)
    text = table_path.read_text()
    assert "MEASURED UNDER LOAD" not in text and f"N ranks as {common.PINNED}, then `--torch-threads 1`" in text
    assert "## vpg_mpi.py on CartPole-v1" in text and "546 -> 1040" in text
    assert "sync with allreduce means the flat" in text and "sync with gather means the gather" in text
    rows = common.table_rows(text, "mode")
    expected = [[mode, n, str(100 * int(n))] for mode in ("allreduce", "gather") for n in "12"]
    assert [row[:3] for row in rows] == [*expected, ["independent", "2", "200"]]
    cores = sorted(os.sched_getaffinity(0))
    sps = {}
    # the ceiling: two 1-rank allreduce runs at the same time, copy i alone on core i, SPS summed
    copies = [work / "runs" / f"scaling__vpg_mpi__independent__2ranks__copy{i}" for i in range(2)]
    copy_sps = [common.measure(copy, "vpg_mpi.py", "independent", 1).sps for copy in copies]
    for i, copy in enumerate(copies):
        assert common.read_hyperparameters(copy)["sync"] == "allreduce"
        log = (work / "logs" / f"{copy.name}.log").read_text()
        assert log.startswith(f"$ (cd {work} && taskset -c {cores[i]} {sys.executable} {ROOT / 'vpg_mpi.py'} ")
    ceiling = rows.pop()
    assert ceiling[3] == f"{sum(copy_sps):,.0f}"
    for row in rows:
        mode, ranks = row[0], int(row[1])
        name = f"scaling__vpg_mpi__{mode}__{ranks}ranks"
        events = common.read_scalar_events(work / "runs" / name)
        assert [step for _, step, _ in events["charts/SPS"]] == [100 * ranks * i for i in (1, 2, 3)]  # 3 iterations
        (wall_1, step_1, _), (wall_3, step_3, _) = events["charts/SPS"][0], events["charts/SPS"][-1]
        sps[mode, ranks] = (step_3 - step_1) / (wall_3 - wall_1)
        assert row[3] == f"{sps[mode, ranks]:,.0f}"
        assert row[7] == f"{np.median([value for _, _, value in events['perf/rollout_time']][1:]):.3f}"
        assert row[9] == f"{np.median([value for _, _, value in events['perf/sync_time']][1:]):.3f}"
        assert float(row[9]) <= float(row[8])  # sync is part of the update
        hyperparameters = common.read_hyperparameters(work / "runs" / name)
        assert (hyperparameters["torch_threads"], hyperparameters["sync"]) == ("1", mode)
        log = (work / "logs" / f"{name}.log").read_text()
        if ranks == 1:
            assert log.startswith(f"$ (cd {work} && taskset -c {cores[0]} {sys.executable} {ROOT / 'vpg_mpi.py'} ")
            assert "pin_rank" not in log
        else:
            assert f"taskset -c {cores[0]},{cores[1]} env PYTHONPATH=" in log
            assert f"{sys.executable} {ROOT / 'vpg_mpi.py'} --nprocs 2 --collectives torch " in log
            assert f"pin_rank: local rank 0 on core {cores[0]}\n" in log
            assert f"pin_rank: local rank 1 on core {cores[1]}\n" in log
        speedup = sps[mode, ranks] / sps[mode, 1]  # against the 1-rank row of the same mode
        assert row[5:7] == [f"{speedup:.2f}", f"{speedup / ranks:.0%}"]
    assert ceiling[5] == f"{sum(copy_sps) / sps['allreduce', 1]:.2f}"  # against the first mode's 1-rank row

    model_path = scaling_model.main(["--from", str(table_path), "--out", str(tmp_path / "model")])
    predictions = common.table_rows(model_path.read_text(), "script | mode | model: what grows with N")
    assert [(row[1], row[3]) for row in predictions] == [
        (mode, n) for mode in ("allreduce", "gather") for _ in range(2) for n in ("2", "8", "64", "512")
    ]
    gather_2 = next(row for row in predictions if row[1] == "gather" and row[3] == "2")
    assert gather_2[6] == rows[3][6]  # the measured 2-rank efficiency beside the model's


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="2 ranks on 2 cores need 2 usable cores")
@pytest.mark.parametrize("side_by_side", [False, True], ids=["one-after-the-other", "side-by-side"])
def test_stragglers_runs_a_slow_env_rank_waiting_and_preempting_and_its_cpu_hog_always_dies(side_by_side, tmp_path):
    # the slow env's cost per step: DDRL_STEP_MS, DDRL_SLOW_FACTOR times that on rank 1
    assert stragglers.step_seconds({"DDRL_STEP_MS": "2", "DDRL_SLOW_FACTOR": "3", "RANK": "1"}) == pytest.approx(0.006)
    assert stragglers.step_seconds({"DDRL_STEP_MS": "2", "DDRL_SLOW_FACTOR": "3", "RANK": "0"}) == pytest.approx(0.002)
    # the CPU hog of the other cases: pinned to its core while the block runs, dead after it, also after an error
    core = sorted(os.sched_getaffinity(0))[-1]
    with pytest.raises(RuntimeError, match="boom"), stragglers.cpu_hog(core) as hog:
        assert os.sched_getaffinity(hog.pid) == {core} and hog.poll() is None
        raise RuntimeError("boom")
    assert hog.returncode is not None

    work = tmp_path / "work"
    argv = ["--cases", "rollout-dominated", "--iterations", "2", "--local-steps", "64", "--step-ms", "0.2"]
    argv += ["--out", str(tmp_path / "stragglers"), "--out-dir", str(work), "--max-load", "1000"]
    argv += ["--side-by-side"] * side_by_side
    table_path, png_path = stragglers.main([*argv, "--", "--num-minibatches", "2", "--update-epochs", "1"])
    assert_png(png_path)
    text = table_path.read_text()
    assert ("- side by side: each case's waiting and preempting runs ran at the same time" in text) == side_by_side
    assert "- command: `python -m benchmark.stragglers --cases rollout-dominated" in text
    assert "![stragglers](stragglers.png)" in text and "- rollout-dominated (ppo_continuous_mpi.py on " in text
    rows = common.table_rows(text, "case")
    assert [row[:2] for row in rows] == [["rollout-dominated", "wait"], ["rollout-dominated", "preempt 0.5"]]
    sps = []
    for row, mode in zip(rows, ("wait", "preempt"), strict=True):
        run_dir = work / "runs" / f"stragglers__rollout-dominated__{mode}"
        events = common.read_scalar_events(run_dir)["charts/SPS"]
        assert int(row[2]) == len(events) >= 2 and events[-1][1] >= 2 * 2 * 64  # every run trains 2+ iterations
        sps.append((events[-1][1] - events[0][1]) / (events[-1][0] - events[0][0]))
        assert row[3] == f"{sps[-1]:,.0f}"
        assert common.read_hyperparameters(run_dir)["preempt_fraction"] == ("0.0" if mode == "wait" else "0.5")
        log = (work / "logs" / f"{run_dir.name}.log").read_text()
        assert log.startswith(f"$ (cd {work} && env DDRL_STEP_MS=0.2 DDRL_SLOW_FACTOR=3 taskset -c ")
        assert "pin_rank: local rank 1 on core" in log
    assert [row[4] for row in rows] == ["1.00", f"{sps[1] / sps[0]:.2f}"]
    assert rows[0][9] == "1.00"  # waiting: every iteration collects the full world batch
    assert 0.62 <= float(rows[1][9]) <= 1.0  # preempting: one whole rollout and at least a quarter of the other


def model_seconds(**changes: float) -> scaling_model.Seconds:
    values = dict(iteration=1.0, update=0.25, sync1=0.05, sync2=0.175, update2=0.5, efficiency2=0.8)
    return scaling_model.Seconds(**{**values, **changes})


def test_scaling_model_arithmetic_on_known_seconds():
    seconds = model_seconds()  # T(1) = 1, u = 0.25, s = 0.05, c = 0.125, learner 0.2 at 1 rank and 0.325 at 2
    assert [seconds.added, seconds.learner, seconds.learner2] == pytest.approx([0.125, 0.2, 0.325])
    efficiency = scaling_model.efficiency
    for n in (1, 2, 8, 64, 512):
        outside_update = 1.0 - 0.25
        gather = outside_update + n * 0.2 + 0.05 + 0.125 * (n - 1)  # the learner's update x N, gather + broadcast x N-1
        fitted = outside_update + 0.2 + (0.325 - 0.2) * (n - 1) + 0.05 + 0.125 * (n - 1)
        assert efficiency(seconds, "gather", n, "linear", 0.0) == pytest.approx(1.0 / gather)
        assert efficiency(seconds, "gather", n, "fitted", 0.0) == pytest.approx(1.0 / fitted)
        assert efficiency(seconds, "allreduce", n, "gloo", 0.0) == pytest.approx(1.0 / (1.0 + 0.125 * (n - 1)))
        assert efficiency(seconds, "DDP", n, "NCCL", 0.0) == pytest.approx(1.0 / (1.0 + 0.125 * np.log2(n)))
        ring_bytes = 2 * (n - 1) / n
        assert efficiency(seconds, "allreduce", n, "gloo", 1.0) == pytest.approx(1.0 / (1.0 + 0.125 * ring_bytes))
        mixed = 0.25 * (n - 1) + 0.75 * ring_bytes
        assert efficiency(seconds, "allreduce", n, "gloo", 0.75) == pytest.approx(1.0 / (1.0 + 0.125 * mixed))
    # gloo: 1 + 0.125 (N-1) > 2 from N = 10; gather (linear): 0.8 + 0.325 N - 0.125 > 2 from N = 5 (4: 1.975)
    assert scaling_model.stops_paying(seconds, "allreduce", "gloo", 0.0) == 10
    assert scaling_model.stops_paying(seconds, "gather", "linear", 0.0) == 5
    assert scaling_model.stops_paying(seconds, "allreduce", "NCCL", 0.0) == 257  # 0.125 log2 N > 1 from N = 2^8 + 1
    assert scaling_model.stops_paying(model_seconds(sync2=0.05), "allreduce", "gloo", 0.0) is None  # no added sync
    assert scaling_model.stops_paying(seconds, "allreduce", "gloo", 1.0) is None  # bandwidth: at most 2c


def test_scaling_model_reads_back_the_scaling_table(tmp_path):
    def row(mode: str, ranks: int, sps: float, update: float, sync: float) -> common.Measurement:
        return common.Measurement("vpg_mpi.py", mode, ranks, 4000 * ranks, 3, sps, sps, 0.5, update, sync)

    measurements = [
        row("allreduce", 1, 4000.0, 0.25, 0.05),  # T(1) = 1.0 s
        row("allreduce", 2, 7000.0, 0.375, 0.175),
        row("gather", 1, 3200.0, 0.3, 0.0),  # T(1) = 1.25 s
        row("gather", 2, 5000.0, 0.6, 0.1),
        row("gather", 4, 9000.0, 1.0, 0.3),
    ]
    text = f"## vpg_mpi.py on HalfCheetah-v5\n\n{scaling.scaling_table(measurements)}\nsync with ...\n"
    text += "\n## Reference: mpi_util\n\n" + scaling.reference_table()
    measured = scaling_model.read_scaling(text)
    assert measured == {
        ("vpg_mpi.py", "allreduce"): scaling_model.Seconds(1.0, 0.25, 0.05, 0.175, 0.375, 0.88),
        ("vpg_mpi.py", "gather"): scaling_model.Seconds(1.25, 0.3, 0.0, 0.1, 0.6, 0.78),
    }
    source = tmp_path / "scaling.md"
    source.write_text(text)
    model_text = scaling_model.main(["--from", str(source), "--out", str(tmp_path / "model")]).read_text()
    assert "MEASURED UNDER LOAD" not in model_text
    predictions = common.table_rows(model_text, "script | mode | model: what grows with N")
    gloo_8 = next(row for row in predictions if row[1] == "allreduce" and row[3] == "8" and "gloo" in row[2])
    assert gloo_8[4:6] == [f"{8 / (1 + 0.125 * 7):.2f}", f"{1 / (1 + 0.125 * 7):.0%}"]
    assert "- vpg_mpi.py allreduce (gloo ring: latency x (N-1)): below 50% from 10 ranks" in model_text


def test_grad_sync_table_with_few_repetitions(tmp_path):
    argv = ["--nprocs", "2", "--repeats", "2", "--warmup", "1", "--cnn-batch", "4", "--mlp-batch", "8"]
    table_path = grad_sync.main([*argv, "--out", str(tmp_path / "grad_sync"), "--max-load", "-1"])
    text = table_path.read_text()
    assert text.splitlines()[2].startswith("**MEASURED UNDER LOAD")  # above the load limit: said at the top
    rows = common.table_rows(text, "model")
    methods = {(row[0].split(".")[0], row[2]) for row in rows}
    expected = {("vpg_mpi", "gather+broadcast"), ("vpg_mpi", "gather+broadcast, MPI")}  # ranks started by mpirun
    expected |= {
        (model, method)
        for model in ("vpg_mpi", "ppo_continuous_mpi", "ppo_atari_multigpu")
        for method in ("per-parameter", "flat", "flat, MPI", "DDP")
    }
    assert methods == expected and len(rows) == len(expected)
    for row in rows:
        assert row[7] == "yes", row  # every method averaged (or gathered and broadcast) correctly
        assert re.fullmatch(r"-?\d+\.\d+( \(\d+\.\d+-\d+\.\d+\))?", row[3]), row
        assert float(row[6]) == pytest.approx(float(row[4]) * int(row[5]), abs=0.1 * int(row[5])), row  # mean x syncs
    assert "1,686,693 in 12 tensors" in text  # the Nature CNN, built by ppo_atari_multigpu.Agent


def test_weight_check_times_the_check_beside_each_scripts_iteration(tmp_path):
    out = tmp_path / "weight_check"
    argv = ["--scripts", "vpg_mpi.py", "--repeats", "3", "--iterations", "2", "--local-steps", "500", "--out", str(out)]
    text = weight_check.main(argv).read_text()
    [row] = common.table_rows(text, "script")
    assert row[0] == "vpg_mpi.py" and int(row[1].replace(",", "")) > 1000  # its two (64, 64) networks
    assert float(row[2]) > 0 and float(row[3]) > 0 and row[4].endswith("%")


def test_startup_times_the_batch_table_then_the_first_progress_line_then_the_exit(tmp_path):
    argv = ["--script", "vpg_mpi.py", "--ranks", "1", "--rounds", "1", "--out", str(tmp_path / "startup")]
    text = startup.main(argv).read_text()
    [row] = common.table_rows(text, "checkout")
    assert row[0].endswith("(this checkout)")
    table, progress, end = float(row[1]), float(row[2]), float(row[4])
    assert 0 < table < progress < end
    assert "--steps-per-epoch 4000 --total-timesteps 8000" in text  # two iterations of the default batch
