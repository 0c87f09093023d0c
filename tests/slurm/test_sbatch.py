"""The project's own sbatch script (scripts/slurm/gspo.sbatch) on a real, throw-away Slurm cluster.

Two fake nodes on this machine (scripts/ci/slurm_cluster.sh: Debian's Slurm, 8 fake GPUs per node so the
H100 directives stand unchanged). The script is submitted as is; only its environment selects the tiny
CPU config: the SGLang server on node 1, one trainer rank on each node (TP2 across the two nodes, gloo).

Requeue (preemption): `scontrol requeue` once the step-2 checkpoint exists. Slurm SIGTERMs every step; the
trainer stops with a checkpoint of where it is, the job comes back, the trainer resumes from that checkpoint
and completes, and metrics.jsonl holds every step once. A random model's steps take 0.3-4 s here and the
signal lands a few seconds after the requeue (one CI run saw two more steps finish first), so the run is
long enough that the signal always arrives before its end and the resumed job has steps left to do. Slurm holds a requeued job for two minutes before it may start again; the test lifts that hold
(`scontrol update StartTime=now`), which changes scheduling only.
"""
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.sglang, pytest.mark.e2e]
REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "scripts/ci/slurm_cluster.sh"
SBATCH = REPO / "scripts/slurm/gspo.sbatch"
K = 2  # gspo.num_minibatches: optimizer steps (metrics records) per rollout step


def _bash(command: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"source {HELPER} && {command}"], env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """SLURM_CONF of a 2-node cluster, up for this module and always torn down (jobs cancelled first)."""
    env = {**os.environ, "SLURM_CI_DIR": str(tmp_path_factory.mktemp("slurm")), "SLURM_CI_NODES": "2"}
    installed = _bash("slurm_install", env, timeout=600)
    if installed.returncode != 0:
        pytest.skip(f"Slurm is not installed and cannot be installed here: {installed.stdout.strip()[-500:]}")
    try:
        up = _bash("slurm_up", env)
        assert up.returncode == 0, f"the CI Slurm cluster did not come up:\n{up.stdout}"
        yield {**env, "SLURM_CONF": str(Path(env["SLURM_CI_DIR"]) / "slurm.conf")}
    finally:
        _bash("slurm_down", env)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from megatron_gspo.dev.tiny_model import make_tiny_qwen3
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "hf")


def submit(cluster: dict, run_dir: Path, hf: Path, overrides: str) -> str:
    """Submit gspo.sbatch unchanged; the environment selects the tiny CPU run on 2 fake nodes."""
    from megatron_gspo.net import free_port

    env = {**cluster, "CONFIG": "examples/tiny_cpu.yaml", "RUN_DIR": str(run_dir),
           "OVERRIDES": f"model.hf_path={hf} gspo.prompts_per_step=4 gspo.group_size=4 gspo.num_minibatches={K} "
                        f"gspo.dynamic_sampling=false {overrides}",  # a random model scores ~0: no extra rounds
           "TRAIN_ON_ROLLOUT_NODES": "1", "NPROC_PER_NODE": "1", "SGLANG_DEVICE": "cpu", "SERVERS_PER_NODE": "1",
           "SGLANG_PORT": str(free_port()), "MASTER_PORT": str(free_port())}
    out = subprocess.run(["sbatch", "--parsable", "--nodes=2", f"--output={run_dir}.log", str(SBATCH)], cwd=REPO,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
    assert out.returncode == 0, out.stdout
    return out.stdout.strip().split(";")[0]


def job_field(cluster: dict, job_id: str, name: str) -> str:
    info = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=cluster, stdout=subprocess.PIPE,
                          text=True, timeout=30).stdout
    match = re.search(rf"\b{name}=(\S*)", info)
    return match.group(1) if match else ""


def wait_until(predicate, timeout_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}; job log:\n{tail(log)}")
        time.sleep(0.5)


def wait_job(cluster: dict, job_id: str, timeout_s: float, log: Path) -> str:
    out = _bash(f"slurm_wait {job_id} {int(timeout_s)}", cluster, timeout=timeout_s + 60)
    return out.stdout.strip() + "\n" + tail(log)


def tail(log: Path, lines: int = 60) -> str:
    text = log.read_text(errors="replace") if log.exists() else "(no job log)"
    return "\n".join(line for line in text.splitlines() if "warn" not in line.lower())[-6000:]


def checkpointed_step(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        return int(latest.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def nodes_idle(cluster: dict) -> bool:
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=cluster, stdout=subprocess.PIPE, text=True,
                            timeout=30).stdout.split()
    return bool(states) and all(state == "idle" for state in states)


def release_requeued(cluster: dict, job_id: str, log: Path) -> None:
    """A requeued job waits ~2 minutes (BeginTime) before it may run again: let it start now, once its
    nodes have finished with its first run and a wall-clock second has passed. Relaunched sooner, Slurm
    22.05 fails it (slurmd: "Job N already killed, do not launch batch job"; the job FAILED, no output):
    the kill revoked the job's credential, and a credential reissued within the same second of the
    revocation counts as revoked (seen: batch done at :42.16, relaunch at :42.90 failed; :41.54 / :42.27
    ran)."""
    wait_until(lambda: job_field(cluster, job_id, "JobState") == "PENDING", 120, "the job to be requeued", log)
    wait_until(lambda: nodes_idle(cluster), 120, "the nodes to be idle after the requeue", log)
    time.sleep(2.0)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=cluster, check=True, timeout=30)


def test_requeued_job_resumes_from_its_checkpoint_and_completes(cluster, tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    log = Path(f"{run_dir}.log")
    steps = 16
    job = submit(cluster, run_dir, tiny_model, f"num_steps={steps} checkpoint.interval=2")
    wait_until(lambda: checkpointed_step(run_dir) >= 2 or job_field(cluster, job, "JobState") not in
               ("PENDING", "RUNNING", "CONFIGURING"), 420, "the step-2 checkpoint", log)
    assert 2 <= checkpointed_step(run_dir) < steps, f"no step-2 checkpoint, or the run ended first:\n{tail(log)}"
    subprocess.run(["scontrol", "requeue", job], env=cluster, check=True, timeout=30)
    release_requeued(cluster, job, log)
    result = wait_job(cluster, job, 480, log)

    assert result.startswith("COMPLETED 0:0"), result
    assert job_field(cluster, job, "Restarts") == "1", result
    text = log.read_text()
    assert "(restart 0)" in text and "(restart 1)" in text, result
    resumed = re.findall(r"resumed from (\S+) at step (\d+)", text)
    assert len(resumed) == 1 and Path(resumed[0][0]).resolve() == (run_dir / "checkpoints").resolve(), result
    # The trainer stopped cleanly on Slurm's SIGTERM with a checkpoint of where it stopped (the step that
    # was running if it finished, the one before if the server, signalled too, failed its rollout first),
    # and the requeued job resumed from exactly that step with steps still to do.
    stopped = re.findall(r"stopping on SIGTERM after step (\d+)", text)
    assert stopped and int(resumed[0][1]) == int(stopped[0]), result
    assert 2 <= int(stopped[0]) < steps, f"the signal did not land mid-run (stopped after {stopped[0]}):\n{result}"
    everything = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in everything if "loss/value" in r]  # the optimizer steps' records
    assert [r["step"] for r in records] == list(range(1, steps * K + 1)), "steps missing or logged twice"
    # Held-out eval (examples/tiny_cpu.yaml): once before training and once at the end, across the requeue.
    assert [r["rollout_step"] for r in everything if "eval/held_out/mean@16" in r][::-1][:1] == [steps]
    assert [r["rollout_step"] for r in everything if "eval/held_out/mean@16" in r][0] == 0
    assert [r["rollout_step"] for r in records] == [s for s in range(1, steps + 1) for _ in range(K)]
    assert checkpointed_step(run_dir) == steps
    assert (run_dir / "checkpoints" / f"iter_{steps:07d}" / "trainer.pt").is_file()
    # The resumed trainer gave the restarted server its weights: the last step was sampled by the version
    # the step before it produced.
    assert records[-1]["rollout/weight_version"] == str(steps - 1), records[-1]


@pytest.mark.slow
def test_time_limit_signal_checkpoints_then_the_job_requeues_itself(cluster, tiny_model, tmp_path):
    # What Slurm does before the time limit (#SBATCH --signal=B:USR1@600), sent by hand: the script asks
    # the trainer to stop, the trainer finishes its step and saves (only the signal saves here: interval
    # 100), the script requeues the job, and the job resumes from that checkpoint.
    run_dir = tmp_path / "run"
    log = Path(f"{run_dir}.log")
    steps = 10  # enough that the signal lands before the end (see the module docstring)
    job = submit(cluster, run_dir, tiny_model, f"num_steps={steps} checkpoint.interval=100")
    metrics = run_dir / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and sum('"loss/value"' in line for line in metrics.read_text().splitlines()) >= K,
               420, "step 1", log)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=cluster, check=True, timeout=30)
    release_requeued(cluster, job, log)
    result = wait_job(cluster, job, 480, log)

    assert result.startswith("COMPLETED 0:0"), result
    text = log.read_text()
    stopped = re.findall(r"stopping on SIGTERM after step (\d+)", text)
    resumed = re.findall(r"resumed from \S+ at step (\d+)", text)
    assert "time limit near" in text and stopped and resumed == stopped, result
    assert int(stopped[0]) < steps and checkpointed_step(run_dir) == steps
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss/value" in r]  # not eval's
    assert [r["step"] for r in records] == list(range(1, steps * K + 1))

