"""benchmark/: every entry point on tiny budgets (real torchrun runs, real gloo groups), no timing asserts."""

import os
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmark import atari_step, common, compile_cost, faults, grad_sync, plot, run, scaling, stragglers, throughput
from benchmark import collectives as allreduce_latency
from ddrl import rollout
from tests.helpers import ROOT, read_scalars, run_command

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="2 ranks on 2 cores need 2 usable cores")


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5_000, path


@pytest.mark.parametrize(
    "module",
    [run, plot, scaling, grad_sync, allreduce_latency, stragglers, atari_step, throughput, faults, compile_cost],
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
    assert f"{len(os.sched_getaffinity(0))} usable cores" in header
    lscpu = run_command(["lscpu"], Path.cwd()).stdout  # the machine as lscpu names it
    assert common.cpu_model().startswith(re.search(r"Model name:\s*(.*)", lscpu).group(1).strip())


def test_each_run_is_one_launch_through_the_scripts_nprocs_named_by_its_env_id_and_seed():
    args = run.Args(script="vpg_mpi.py", env_ids=("CartPole-v1", "Pendulum-v1"))
    expected = {
        f"vpg_mpi__{env_id}__{seed}": [
            *(sys.executable, str(ROOT / "vpg_mpi.py"), "--nprocs", "2"),
            *("--env-id", env_id, "--seed", str(seed), "--run-name", f"vpg_mpi__{env_id}__{seed}"),
            *("--total-timesteps", "400"),
        ]
        for env_id in ("CartPole-v1", "Pendulum-v1")
        for seed in (1, 2, 3)
    }
    assert run.plan(args, ["--total-timesteps", "400"]) == expected


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
    with pytest.raises(SystemExit, match=r"exist\(s\): choose another --out-dir"):
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
    assert plot.main(["--values", *map(str, wild), "--steps", "10"]) == cell
    with pytest.raises(SystemExit, match="give run folders, or --values alone"):
        plot.main(["runs", "--values", "1", "2"])


def test_atari_step_splits_a_step_into_parts_beside_the_env_only_rate_acting_as_the_agent(tmp_path):
    argv = ["--envs", "2", "--steps", "4", "--env-seconds", "0.05", "--num-steps", "8"]
    text = atari_step.main([*argv, "--out", str(tmp_path / "step"), "--max-load", "1000"]).read_text()
    assert re.search(r"torch and env threads: [1-9]\d* \(the script's rule at one rank\)", text)
    rows = common.table_rows(text, "configuration")
    assert [row[:2] for row in rows] == [["2 envs", "cpu"]]
    for row in rows:
        parts = [float(cell.split()[0]) for cell in row[2:5]]
        shares = [int(cell.split("(")[1].rstrip("%)")) for cell in row[2:5]]
        assert float(row[5]) == pytest.approx(sum(parts), abs=0.003) and abs(sum(shares) - 100) <= 3
        step_ms = float(row[6])
        assert float(row[7].replace(",", "")) == pytest.approx(int(row[0].split()[0]) / step_ms * 1e3, rel=0.01)
    # the acting step fills the storage with what the Agent computes (ddrl.rollout.check exits unless they agree)
    stepper = atari_step.Stepper(torch.device("cpu"), 2, 1, 4)
    stepper.run(4, synced=True)
    stepper.envs.close()
    batch = {key: value.flatten(0, 1) for key, value in stepper.storage.items()}
    rollout.check(stepper.agent, batch, "in the test", "the acting step", rows=8)


def test_scaling_builds_pinned_one_thread_commands_for_every_script_and_mode():
    assert scaling.script_modes("vpg_mpi.py", ("allreduce", "gather")) == ["allreduce", "gather"]
    assert scaling.script_modes("ppo_continuous_mpi.py", ("gather",)) == ["gather"]
    assert scaling.script_modes("ppo_atari_multigpu.py", ("allreduce", "gather")) == ["DDP"]
    assert [scaling.rank_counts((), cores) for cores in (1, 2, 6, 8)] == [[1], [1, 2], [1, 2, 4, 6], [1, 2, 4, 8]]
    assert scaling.rank_counts((3,), 4) == [1, 3]
    with pytest.raises(SystemExit, match="between 1 and the 4 usable cores"):
        scaling.rank_counts((5,), 4)
    args = scaling.Args(scripts=("vpg_mpi.py",), ranks=(2,), launchers=("torchrun", "mpirun"), iterations=2)
    assert scaling.jobs(args, "vpg_mpi.py", [1, 2]) == [  # the machine's ceiling first, then each mode's ranks
        ("independent", 2, ""), *(("allreduce", n, "torchrun") for n in (1, 2)),
        *(("gather", n, "torchrun") for n in (1, 2)), ("allreduce mpirun", 2, "mpirun"), ("gather mpirun", 2, "mpirun"),
    ]  # fmt: skip
    assert scaling.jobs(args, common.ATARI, [1, 2])[-1] == ("DDP", 2, "torchrun")  # no mpirun rows for Atari

    cores = [3, 5, 7]
    args = scaling.script_args("ppo_continuous_mpi.py", "gather", 1, 2048, 4)
    assert args == [
        *("--torch-threads", "1", "--sync", "gather", "--num-steps", "2048"),
        *("--total-timesteps", "8192", "--local-num-envs", "1"),
    ]
    script = ROOT / "ppo_continuous_mpi.py"
    assert common.script_command(script, args, 1, "torchrun", cores) == [
        *("taskset", "-c", "3", sys.executable, str(script), *args)
    ]
    args = scaling.script_args("ppo_atari_multigpu.py", "DDP", 2, 1024, 3)
    assert args == [
        *("--torch-threads", "1", "--env-threads", "1", "--num-steps", "128"),
        *("--total-timesteps", "6144", "--local-num-envs", "8"),
    ]
    # N ranks: the script's own --nprocs launch, each rank pinned as it starts by benchmark/pin_rank/sitecustomize.py
    pin_path = os.pathsep.join(filter(None, [str(ROOT / "benchmark" / "pin_rank"), os.environ.get("PYTHONPATH")]))
    pin = [f"PYTHONPATH={pin_path}"]
    for launcher, collectives in (("torchrun", "shm"), ("mpirun", "mpi")):
        assert common.script_command(ROOT / "ppo_atari_multigpu.py", args, 2, launcher, cores) == [
            *("taskset", "-c", "3,5", "env", *pin, "DDRL_PIN_CORES=3,5", sys.executable),
            *(str(ROOT / "ppo_atari_multigpu.py"), "--nprocs", "2", "--collectives", collectives, *args),
        ]
    args = scaling.script_args("vpg_mpi.py", "allreduce", 3, 100, 2)
    assert args[-6:] == ["--steps-per-epoch", "300", "--total-timesteps", "600", "--local-num-envs", "1"]
    # no local steps: each script's own default batch (VPG's at 1 rank), as benchmark.throughput runs them by default
    totals = {script: common.budget_args(script, 1, 0, 2)[-3] for script in common.SCRIPTS}
    assert totals == {"vpg_mpi.py": "8000", "ppo_continuous_mpi.py": "4096", "ppo_atari_multigpu.py": "2048"}
    assert common.budget_args(common.ATARI, 2, 1024, 3, envs=32)[:2] == ["--num-steps", "32"]  # --local-envs
    with pytest.raises(SystemExit, match="--local-steps 100 is no multiple of 8 envs"):
        common.budget_args(common.ATARI, 1, 100, 2)
    with pytest.raises(ValueError, match="4 ranks but only 3 usable cores"):
        common.script_command(ROOT / "vpg_mpi.py", args, 4, "torchrun", cores)


def test_scaling_rounds_give_each_rounds_speedup_against_the_same_rounds_baseline():
    def measurement(ranks: int, sps: float) -> common.Measurement:
        return common.Measurement("vpg_mpi.py", "allreduce", ranks, 100 * ranks, 3, sps, sps, 1.0, 1.0, 0.1)

    rounds = {
        ("vpg_mpi.py", "allreduce", 1): [measurement(1, 100.0), measurement(1, 120.0), measurement(1, 80.0)],
        ("vpg_mpi.py", "allreduce", 2): [measurement(2, 190.0), measurement(2, 180.0), measurement(2, 168.0)],
        ("vpg_mpi.py", "independent", 2): [measurement(2, 200.0), measurement(2, 228.0), measurement(2, 160.0)],
    }
    assert scaling.round_speedups(rounds) == (
        "- allreduce, 2 ranks: speedup per round 1.90, 1.50, 2.10; median 1.90\n"
        "- independent, 2 ranks: speedup per round 2.00, 1.90, 2.00; median 2.00\n"  # against the first mode's 1 rank
    )
    # the machine's ceiling (N copies at once, their SPS summed) against the first mode's 1-rank row, as the others
    ceiling = common.Measurement("vpg_mpi.py", "independent", 2, 200, 3, 210.0, 210.0, 1.0, 1.0, 0.0)
    [_, row] = common.table_rows(scaling.scaling_table([rounds["vpg_mpi.py", "allreduce", 1][0], ceiling]), "mode")
    assert row[:2] == ["independent", "2"] and row[5:7] == ["2.10", "105%"]


def test_run_logged_runs_its_commands_side_by_side_logs_each_and_names_a_failure(tmp_path):
    # each command waits (at most 300 s) for the other's file: run one after the other, the first would time out
    wait = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); t = time.time() + 300\n"
    wait += "while not pathlib.Path(sys.argv[2]).exists() and time.time() < t: time.sleep(0.01)\n"
    wait += "print('saw', sys.argv[2], pathlib.Path(sys.argv[2]).exists()); sys.exit(int(sys.argv[3]))"
    commands = {"a": [sys.executable, "-c", wait, "a", "b", "0"], "b": [sys.executable, "-c", wait, "b", "a", "3"]}
    with pytest.raises(SystemExit, match=r"run b failed \(exit 3\)"):
        common.run_logged(commands, tmp_path, at_once=True)
    for (name, command), other in zip(commands.items(), "ba", strict=True):
        log = (tmp_path / "logs" / f"{name}.log").read_text()
        assert log == f"$ (cd {tmp_path} && {shlex.join(command)})\nsaw {other} True\n"


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


@TWO_CORES
def test_scaling_two_ranks_on_two_cores_then_the_model_from_its_table(tmp_path):
    work = tmp_path / "work"
    argv = ["--scripts", "vpg_mpi.py", "--ranks", "2", "--iterations", "2", "--local-steps", "100"]
    argv += ["--sync-modes", "allreduce", "--no-independent", "--out", str(tmp_path / "s")]
    table_path, png_path = scaling.main([*argv, "--out-dir", str(work), "--max-load", "1000"])
    assert_png(png_path)
    text = table_path.read_text()
    assert "MEASURED UNDER LOAD" not in text and f"N ranks as {common.PINNED}, then `--torch-threads 1`" in text
    assert "## vpg_mpi.py on HalfCheetah-v5" in text
    assert "sync with allreduce means the flat" in text
    rows = common.table_rows(text, "mode")
    assert [row[:3] for row in rows] == [["allreduce", "1", "100"], ["allreduce", "2", "200"]]
    cores = sorted(os.sched_getaffinity(0))
    sps = {}
    for row in rows:
        ranks = int(row[1])
        name = f"scaling__vpg_mpi__allreduce__{ranks}ranks"
        events = common.read_scalar_events(work / "runs" / name)
        assert [step for _, step, _ in events["charts/SPS"]] == [100 * ranks * i for i in (1, 2)]  # 2 iterations
        (wall_1, step_1, _), (wall_2, step_2, _) = events["charts/SPS"]
        sps[ranks] = (step_2 - step_1) / (wall_2 - wall_1)
        assert row[3] == f"{sps[ranks]:,.0f}"
        assert (
            row[7] == f"{events['perf/rollout_time'][1][2]:.3f}" and row[9] == f"{events['perf/sync_time'][1][2]:.3f}"
        )
        assert float(row[9]) <= float(row[8])  # sync is part of the update
        hyperparameters = common.read_hyperparameters(work / "runs" / name)
        assert (hyperparameters["torch_threads"], hyperparameters["sync"]) == ("1", "allreduce")
        log = (work / "logs" / f"{name}.log").read_text()
        if ranks == 1:
            assert log.startswith(f"$ (cd {work} && taskset -c {cores[0]} {sys.executable} {ROOT / 'vpg_mpi.py'} ")
            assert "pin_rank" not in log
        else:
            assert f"taskset -c {cores[0]},{cores[1]} env PYTHONPATH=" in log
            assert f"{sys.executable} {ROOT / 'vpg_mpi.py'} --nprocs 2 --collectives shm " in log
            assert f"pin_rank: local rank 0 on core {cores[0]}\n" in log
            assert f"pin_rank: local rank 1 on core {cores[1]}\n" in log
        speedup = sps[ranks] / sps[1]  # against the 1-rank row of the same mode
        assert row[5:7] == [f"{speedup:.2f}", f"{speedup / ranks:.0%}"]

    model_path = scaling.main(["--model-from", str(table_path), "--out", str(tmp_path / "model")])
    predictions = common.table_rows(model_path.read_text(), "script | mode | model: what grows with N")
    assert [(row[1], row[3]) for row in predictions] == [
        ("allreduce", n) for _ in range(2) for n in ("2", "8", "16", "64", "512")
    ]
    assert predictions[0][6] == rows[1][6]  # the measured 2-rank efficiency beside the model's


@TWO_CORES
def test_stragglers_runs_a_slow_env_rank_waiting_and_preempting_and_its_cpu_hog_always_dies(tmp_path):
    # the slow env's cost per step: DDRL_STEP_MS, three times that on rank 1
    assert stragglers.step_seconds({"DDRL_STEP_MS": "2", "RANK": "1"}) == pytest.approx(0.006)
    assert stragglers.step_seconds({"DDRL_STEP_MS": "2", "RANK": "0"}) == pytest.approx(0.002)
    # the CPU hog of the other cases: pinned to its core while the block runs, dead after it, also after an error
    core = sorted(os.sched_getaffinity(0))[-1]
    with pytest.raises(RuntimeError, match="boom"), stragglers.cpu_hog(core) as hog:
        assert os.sched_getaffinity(hog.pid) == {core} and hog.poll() is None
        raise RuntimeError("boom")
    assert hog.returncode is not None

    work = tmp_path / "work"
    argv = ["--cases", "rollout-dominated", "--iterations", "2", "--local-steps", "64", "--step-ms", "0.2"]
    argv += ["--out", str(tmp_path / "stragglers"), "--out-dir", str(work), "--max-load", "1000", "--side-by-side"]
    table_path, png_path = stragglers.main([*argv, "--", "--num-minibatches", "2", "--update-epochs", "1"])
    assert_png(png_path)
    text = table_path.read_text()
    assert "- side by side: each case's waiting and preempting runs ran at the same time" in text
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
        assert log.startswith(f"$ (cd {work} && env DDRL_STEP_MS=0.2 taskset -c ")
        assert "pin_rank: local rank 1 on core" in log
    assert [row[4] for row in rows] == ["1.00", f"{sps[1] / sps[0]:.2f}"]
    assert rows[0][9] == "1.00"  # waiting: every iteration collects the full world batch
    assert 0.62 <= float(rows[1][9]) <= 1.0  # preempting: one whole rollout and at least a quarter of the other


def model_seconds(**changes: float) -> scaling.Seconds:
    values = dict(iteration=1.0, update=0.25, sync1=0.05, sync2=0.175, update2=0.5, efficiency2=0.8)
    return scaling.Seconds(**{**values, **changes})


def test_scaling_model_arithmetic_on_known_seconds():
    seconds = model_seconds()  # T(1) = 1, u = 0.25, s = 0.05, c = 0.125, learner 0.2 at 1 rank and 0.325 at 2
    assert [seconds.added, seconds.learner, seconds.learner2] == pytest.approx([0.125, 0.2, 0.325])
    efficiency = scaling.efficiency
    for n in (1, 2, 8, 64, 512):
        outside_update = 1.0 - 0.25
        gather = outside_update + n * 0.2 + 0.05 + 0.125 * (n - 1)  # the learner's update x N, gather + broadcast x N-1
        fitted = outside_update + 0.2 + (0.325 - 0.2) * (n - 1) + 0.05 + 0.125 * (n - 1)
        assert efficiency(seconds, "gather", n, "linear") == pytest.approx(1.0 / gather)
        assert efficiency(seconds, "gather", n, "fitted") == pytest.approx(1.0 / fitted)
        assert efficiency(seconds, "allreduce", n, "gloo") == pytest.approx(1.0 / (1.0 + 0.125 * (n - 1)))
        assert efficiency(seconds, "DDP", n, "NCCL") == pytest.approx(1.0 / (1.0 + 0.125 * np.log2(n)))
    # gloo: 1 + 0.125 (N-1) > 2 from N = 10; gather (linear): 0.8 + 0.325 N - 0.125 > 2 from N = 5 (4: 1.975)
    assert scaling.stops_paying(seconds, "allreduce", "gloo") == 10
    assert scaling.stops_paying(seconds, "gather", "linear") == 5
    assert scaling.stops_paying(seconds, "allreduce", "NCCL") == 257  # 0.125 log2 N > 1 from N = 2^8 + 1
    assert scaling.stops_paying(model_seconds(sync2=0.05), "allreduce", "gloo") is None  # no added sync


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
    text += "\n## Reference\n\n| processes | steps/s |\n|--:|--:|\n| 1 | 546 |\n"  # another table: not read
    measured = scaling.read_scaling(text)
    assert measured == {
        ("vpg_mpi.py", "allreduce"): scaling.Seconds(1.0, 0.25, 0.05, 0.175, 0.375, 0.88),
        ("vpg_mpi.py", "gather"): scaling.Seconds(1.25, 0.3, 0.0, 0.1, 0.6, 0.78),
    }
    source = tmp_path / "scaling.md"
    source.write_text("**MEASURED UNDER LOAD**\n" + text)
    model_text = scaling.main(["--model-from", str(source), "--out", str(tmp_path / "model")]).read_text()
    assert f"THE INPUT WAS MEASURED UNDER LOAD ({source} says so)" in model_text.splitlines()[2]
    predictions = common.table_rows(model_text, "script | mode | model: what grows with N")
    linear_8 = next(row for row in predictions if row[1] == "allreduce" and row[3] == "8" and "(N-1)" in row[2])
    assert linear_8[4:6] == [f"{8 / (1 + 0.125 * 7):.2f}", f"{1 / (1 + 0.125 * 7):.0%}"]
    assert "- vpg_mpi.py allreduce (shared memory, one node: c x (N-1)): below 50% from 10 ranks" in model_text


def test_grad_sync_table_with_few_repetitions(tmp_path):
    argv = ["--nprocs", "2", "--repeats", "2", "--warmup", "1", "--models", "vpg"]
    table_path = grad_sync.main([*argv, "--out", str(tmp_path / "grad_sync"), "--max-load", "-1"])
    text = table_path.read_text()
    assert text.splitlines()[2].startswith("**MEASURED UNDER LOAD")  # above the load limit: said at the top
    rows = common.table_rows(text, "model")
    methods = {(row[0].split(".")[0], row[2]) for row in rows}
    expected = {("vpg_mpi", "gather+broadcast"), ("vpg_mpi", "gather+broadcast, MPI")}  # ranks started by mpirun
    expected |= {("vpg_mpi", method) for method in ("per-parameter", "flat", "flat, MPI", "DDP")}
    assert methods == expected and len(rows) == len(expected)
    for row in rows:
        assert row[7] == "yes", row  # every method averaged (or gathered and broadcast) correctly
        assert re.fullmatch(r"-?\d+\.\d+( \(\d+\.\d+-\d+\.\d+\))?", row[3]), row
        assert float(row[6]) == pytest.approx(float(row[4]) * int(row[5]), abs=0.1 * int(row[5])), row  # mean x syncs
    assert "| vpg_mpi.Agent (64-64 MLPs) | 11,085 in 13 tensors |" in text  # its two (64, 64) networks
    assert "one_learner.gather_union of 2000x" in text  # --sync gather's traffic, VPG's epoch share of each rank


@TWO_CORES
def test_collectives_table_with_few_calls(tmp_path):
    """Each path's ranks start under their own launcher and say what carries their allreduce, which sums right."""
    argv = ["--sizes", "1000", "3000", "--calls", "20", "--warmup", "2", "--max-load", "-1"]
    text = allreduce_latency.main([*argv, "--out", str(tmp_path / "collectives")]).read_text()
    assert text.splitlines()[2].startswith("**MEASURED UNDER LOAD")
    rows = common.table_rows(text, "float32")
    assert [(row[0], row[2]) for row in rows] == [
        (size, path) for size in ("1,000", "3,000") for path in ("shared memory", "gloo", "MPI")
    ]
    for row in rows:
        carried = {"shared memory": "shared memory + gloo", "gloo": "torch gloo", "MPI": "MPI (Open MPI v5"}[row[2]]
        assert row[3].startswith(carried) and row[7] == "yes", row
        assert re.fullmatch(r"\d+\.\d-\d+\.\d", row[6]) and float(row[4]) > 0 and float(row[5]) > 0, row


def final_return(log: str) -> str:
    """The mean of the last 10 iterations' returns in a run's output, each iteration's as its latest line gave it."""
    latest = dict(re.findall(r"^(?:iteration|epoch) (\d+)/\d+ step \d+ SPS \d+ return (\S+)", log, re.MULTILINE))
    values = [float(value) for _, value in sorted(latest.items(), key=lambda item: int(item[0])) if value != "n/a"]
    return f"{np.mean(values[-10:]):.1f}"


@TWO_CORES
def test_faults_kills_and_resizes_runs_that_go_on_beside_an_unkilled_one(tmp_path):
    """Tiny: one kill of the only rank under torchrun --max-restarts 1, and 2 ranks stopped by SIGTERM and resumed at
    1, each beside the unkilled run of the same seed; every attempt trains 2+ iterations."""
    argv = ["--ranks", "1", "--kills", "1", "--world-sizes", "2", "1", "--side-by-side", "--out", str(tmp_path / "f")]
    argv += ["--out-dir", str(tmp_path / "work"), "--", "--env-id", "InvertedPendulum-v5", "--num-steps", "64"]
    argv += ["--num-minibatches", "2", "--update-epochs", "1", "--total-timesteps", "512", "--checkpoint-every", "1"]
    text = faults.main(argv).read_text()
    assert "- command: `python -m benchmark.faults --ranks 1 --kills 1" in text and "; lscpu)" in text
    assert "- side by side: the unkilled run and the scenarios ran at the same time" in text
    rows = {row[0]: row for row in common.table_rows(text, "scenario")}
    assert [rows["kills"][1:4], rows["resize"][1:4]] == [["1", "1", "1"], ["2 -> 1", "1", "1"]]  # faults survived
    # rank 0 holds after each progress line until the fault is sent: the kill lands before that iteration's checkpoint,
    # and SIGTERM is counted in the next iteration, which ends and is saved
    assert rows["kills"][4] == "64 (64)"
    assert rows["resize"][4] == "0 (0)"
    logs = {path.stem: path.read_text() for path in (tmp_path / "work" / "logs").iterdir()}
    assert set(logs) == {"unkilled_1", "kills_1", "resize_1", "resize_2"}
    assert "--nproc_per_node=1 --max-restarts=1 " in logs["kills_1"].splitlines()[0]
    assert "--nproc_per_node=2 " in logs["resize_1"].splitlines()[0] and "--resume" in logs["resize_2"].splitlines()[0]
    assert "stopped by SIGTERM at iteration 3" in logs["resize_1"]  # the first line past 1/2: iteration 2's
    assert "written by 2 ranks and continued by 1" in logs["resize_2"]
    attempts = [part for log in logs.values() for part in re.split("resuming from", log)]
    trained = [len(re.findall(r"^iteration \d+/", part, re.MULTILINE)) for part in attempts]
    assert len([count for count in trained if count]) == 5 and min(count for count in trained if count) >= 2
    assert rows["kills"][-2:] == [final_return(logs["kills_1"]), final_return(logs["unkilled_1"])]
    assert rows["resize"][-2:] == [final_return(logs["resize_1"] + logs["resize_2"]), final_return(logs["unkilled_1"])]


def test_update_table_times_each_variant_beside_the_other_checkout(tmp_path):
    """benchmark.update with this checkout as the other one: each variant's row, and the same code beside itself."""
    from benchmark import update as update_times

    argv = ["--scripts", "vpg_mpi.py", "--rounds", "1", "--compare-with", str(ROOT), "--max-load", "-1"]
    text = update_times.main([*argv, "--out", str(tmp_path / "update")])
    rows = common.table_rows(text.read_text(), "script")
    assert [row[:2] for row in rows] == [["vpg_mpi.py", "this eager"], ["vpg_mpi.py", "other eager"]]
    assert all(float(row[2]) > 0 and int(row[3]) > 0 for row in rows), rows
