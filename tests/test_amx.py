"""AMX tiles for vLLM's CPU attention (`maru.vllm.amx`): where the CPU has them, a
worker with a CPU cache may use them from registration on, so a maru hit that is a
new engine's first forward does not die in vLLM's first tile instruction (SIGILL).
Each check runs in a new process: permission, once given, lasts for the process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.cpu_flags import cpu_flags

ROOT = Path(__file__).resolve().parent.parent


def cpu_has_amx_tiles() -> bool:
    return "amx_tile" in cpu_flags()


def in_a_new_process(script: str) -> list[bool]:
    """Run `script` in a new interpreter at the repository's root; the JSON it prints last."""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_amx_tiles_are_permitted_where_the_cpu_has_them() -> None:
    before, granted, after, again = in_a_new_process(
        "import json\n"
        "from maru.vllm.amx import amx_tiles_permitted, permit_amx_tiles\n"
        "before = amx_tiles_permitted()\n"
        "granted = permit_amx_tiles()\n"
        "print(json.dumps([before, granted, amx_tiles_permitted(), permit_amx_tiles()]))\n"
    )
    assert not before, "a new process has no permission until it asks"
    assert granted == after == again == cpu_has_amx_tiles()


def test_a_worker_with_a_cpu_cache_may_use_amx_tiles_from_registration_on(tiny_model) -> None:
    before, after = in_a_new_process(
        "import json, pathlib\n"
        "from maru.vllm.amx import amx_tiles_permitted\n"
        "from tests.test_connector_worker import kv_caches, worker\n"
        "before = amx_tiles_permitted()\n"
        f"worker(pathlib.Path({str(tiny_model)!r}), 'amx-test', kv_caches(None))\n"
        "print(json.dumps([before, amx_tiles_permitted()]))\n"
    )
    assert not before
    assert after == cpu_has_amx_tiles()
