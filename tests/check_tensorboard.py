"""Reads a directory written by `moe_bridge::tensorboard::EventWriter` with TensorBoard itself.

Not run in CI (CI has no Python). Make the directory with the ignored Rust test, then check it
(needs `pip install tensorboard` in the venv):

    MOE_TENSORBOARD_CHECK_DIR=/tmp/tb-check cargo test -p moe-bridge --lib \\
        tensorboard::tests::write_check_directory -- --ignored
    benches/.venv/bin/python tests/check_tensorboard.py /tmp/tb-check

The directory holds two event files: run 1 (`EventWriter::create(dir, 1)`, a `SessionLog`
START at step 1) logs steps 1..10, run 2 resumes at step 7 (`create(dir, 7)`, START at 7) and
logs 7..12. Tags `train/loss`
(`100 run + step / 4`), `train/lr` (`run * 1e-4 + step * 1e-6`) and `tokens_per_s`
(`run * 1e5 + step * 4096 + 1/3`) are f32 `simple_value`s. TensorBoard must show steps 1..6
from run 1 and 7..12 from run 2, values exact, through

1. the legacy `EventAccumulator` (`Scalars`),
2. `plugin_event_accumulator.EventAccumulator`, the Python loader of the TensorBoard server,
3. a running `tensorboard --logdir DIR` server with `--load_fast=false` (Python loader) and
   `--load_fast=true` (the Rust data server, when its binary is installed), over its HTTP API.
"""

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import numpy as np
from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.util import tensor_util

TAGS = ["tokens_per_s", "train/loss", "train/lr"]


def expected(tag, step):
    run = 1 if step < 7 else 2
    if tag == "train/loss":
        return float(np.float32(np.float32(100 * run) + np.float32(step) / np.float32(4)))
    if tag == "train/lr":
        return float(np.float32(run * 1e-4 + step * 1e-6))
    if tag == "tokens_per_s":
        return float(np.float32(run * 1e5 + step * 4096.0 + 1.0 / 3.0))
    raise KeyError(tag)


def check(name, series):
    """series: tag -> [(step, value)]"""
    assert sorted(series) == TAGS, f"{name}: tags {sorted(series)}"
    for tag, points in sorted(series.items()):
        steps = [s for s, _ in points]
        assert steps == list(range(1, 13)), f"{name} {tag}: steps {steps}"
        for step, value in points:
            want = expected(tag, step)
            assert value == want, f"{name} {tag} step {step}: {value!r} != {want!r}"
        print(f"{name} {tag}: " + ", ".join(f"{s}:{v!r}" for s, v in points))


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def get_json(url, timeout=60):
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.load(r)
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def server_series(path, load_fast):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", path, "--port", str(port),
         "--load_fast", load_fast, "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        base = f"http://localhost:{port}/data/plugin/scalars"
        deadline = time.time() + 60
        while True:
            tags = get_json(f"{base}/tags").get(".", {})
            if sorted(tags) == TAGS or time.time() > deadline:
                break
            time.sleep(0.5)
        series = {}
        for tag in tags:
            q = urllib.parse.urlencode({"run": ".", "tag": tag})
            # [[wall_time, step, value], ...]
            series[tag] = [(s, v) for _, s, v in get_json(f"{base}/scalars?{q}")]
        return series
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        if "data server" in err.lower() or "load_fast" in err.lower():
            print(f"  (server stderr: {err.strip().splitlines()[-1]})")


def main(path):
    legacy = event_accumulator.EventAccumulator(path, size_guidance={event_accumulator.SCALARS: 0})
    legacy.Reload()
    print("file_version", legacy.file_version)
    series = {tag: [(e.step, e.value) for e in legacy.Scalars(tag)] for tag in legacy.Tags()["scalars"]}
    check("EventAccumulator", series)

    server = plugin_event_accumulator.EventAccumulator(path, tensor_size_guidance={"scalars": 0})
    server.Reload()
    series = {
        tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in server.Tensors(tag)]
        for tag in server.PluginTagToContent("scalars")
    }
    check("plugin_event_accumulator", series)

    for load_fast in ["false", "true"]:
        check(f"tensorboard --load_fast={load_fast}", server_series(path, load_fast))
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
