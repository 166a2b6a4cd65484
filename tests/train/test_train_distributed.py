"""The sharded train step: a mesh of 8 CPU devices and two processes joined by jax.distributed
give the same step as one device. Multi-device runs are subprocesses (conftest pins 1 device)."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from support import fitted_models
from support.devices import xla_flags
from dflash_jax import sharding
from dflash_jax.models.target import init_target_params, Target
from train import drafter_init, step as step_lib

ROOT = Path(__file__).resolve().parents[2]
BATCH, LENGTH = 8, 24


def one_step(out: str, data: int = -1, fsdp: int = 1, shard_target: bool = False, coordinator: str | None = None,
             num_processes: int | None = None, process_id: int | None = None, moe: bool = False) -> None:
    """Two train steps of the tiny drafter on a fixed batch over a (data, fsdp) mesh; saves the
    losses and params to `out` (.npz). With a coordinator, joins a jax.distributed job first and
    feeds only this process's rows. moe: the target is a Qwen3-MoE one (test_moe_train's)."""
    sharding.initialize_distributed(coordinator, num_processes, process_id)
    config = fitted_models.MOE_TARGET_CONFIG if moe else fitted_models.TARGET_CONFIG
    target = Target(config, init_target_params(config, jax.random.PRNGKey(0)))
    config = fitted_models.drafter_config(block_size=4)
    mesh = sharding.make_mesh(data=data, fsdp=fsdp)
    schedule = step_lib.learning_rate_schedule(1e-3, 10, 0.1)
    optimizer = step_lib.make_optimizer(schedule)
    spec = step_lib.StepSpec(num_anchors=6, decay=4.0, grad_accum=2)
    state = step_lib.init_state(drafter_init.initial_params(config, target, target.params, jax.random.PRNGKey(1)),
                                optimizer, seed=3)
    state_shardings = sharding.fsdp_shardings(mesh, state)
    frozen = {"target": target.params}
    frozen_shardings = sharding.fsdp_shardings(mesh, frozen, shard=shard_target)
    state, frozen = jax.device_put(state, state_shardings), jax.device_put(frozen, frozen_shardings)
    step = jax.jit(step_lib.make_train_step(target, config, spec, optimizer, schedule),
                   in_shardings=(state_shardings, frozen_shardings, sharding.train_batch_sharding(mesh)),
                   out_shardings=(state_shardings, sharding.replicated(mesh)))
    tokens = fitted_models.pattern_batch(np.random.default_rng(0), BATCH, LENGTH)
    loss_mask = np.arange(LENGTH)[None].repeat(BATCH, 0) >= np.arange(BATCH)[:, None] % 5
    rows = slice(None)
    if jax.process_count() > 1:
        per = BATCH // jax.process_count()
        rows = slice(jax.process_index() * per, (jax.process_index() + 1) * per)
    losses = []
    for _ in range(2):
        batch = sharding.global_batch(mesh, {"tokens": tokens[rows], "loss_mask": loss_mask[rows]})
        state, metrics = step(state, frozen, batch)
        losses.append(float(metrics["loss"]))
    gathered = jax.jit(lambda p: p, out_shardings=sharding.replicated(mesh))(state.params)
    leaves = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(gathered)}
    np.savez(out, losses=np.asarray(losses), **leaves)


def _spawn(code: str, devices: int = 1) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": xla_flags(devices), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(Path(__file__).parent)])}
    return subprocess.Popen([sys.executable, "-c", "import test_train_distributed as t; " + code], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _assert_same(a_path, b_path):
    a, b = np.load(a_path), np.load(b_path)
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
        np.testing.assert_allclose(a[name], b[name], rtol=2e-5, atol=2e-6, err_msg=name)


# Each test starts subprocesses (8 simulated devices; two gloo processes): minutes on 2 cores,
# so they run with `make test-all`, not in the default suite.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "one_device.npz"
    one_step(str(out))
    return out


def test_eight_device_mesh_equals_one_device(reference, tmp_path):
    out = tmp_path / "eight.npz"
    proc = _spawn(f"t.one_step({str(out)!r}, data=2, fsdp=4, shard_target=True)", devices=8)
    assert proc.wait(timeout=300) == 0, proc.stdout.read()
    _assert_same(reference, out)


def test_an_moe_target_sharded_over_eight_devices_trains_as_one(tmp_path):
    """Online features from a Qwen3-MoE target whose weights (experts included) are split by the
    training rules over data=2 x fsdp=4: the same two steps as one device."""
    one_step(str(tmp_path / "one.npz"), moe=True)
    proc = _spawn(f"t.one_step({str(tmp_path / 'eight.npz')!r}, data=2, fsdp=4, shard_target=True, moe=True)",
                  devices=8)
    assert proc.wait(timeout=300) == 0, proc.stdout.read()
    _assert_same(tmp_path / "one.npz", tmp_path / "eight.npz")


def test_two_processes_joined_by_jax_distributed_agree(reference, tmp_path):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = [_spawn(f"t.one_step({str(tmp_path / f'p{i}.npz')!r}, coordinator='localhost:{port}', "
                    f"num_processes=2, process_id={i})") for i in range(2)]
    codes = [p.wait(timeout=300) for p in procs]
    logs = [p.stdout.read() for p in procs]
    if any(codes) and any("collectives" in log.lower() or "gloo" in log.lower() for log in logs):
        pytest.skip("this jax cannot run CPU collectives across processes: " + logs[0][-500:])
    assert codes == [0, 0], logs
    _assert_same(tmp_path / "p0.npz", tmp_path / "p1.npz")
    _assert_same(reference, tmp_path / "p0.npz")
