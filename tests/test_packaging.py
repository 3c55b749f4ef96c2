"""The installed package: flows/ and tasks/ arrive as tokenmill.flows and tokenmill.tasks, never as
top-level `flows` or `tasks` (which would shadow a user's own Prefect project).

The wheel is built from a copy of the sources (so the repository's build/ folder, and any stale
file in it, plays no part) and installed with `pip install --target` into a folder of its own.
The import check runs in a fresh interpreter that cannot see the repository:

- `-S`: no `site`, so no .pth file runs; the venv's editable install of tokenmill is such a .pth
  (it puts a finder on sys.meta_path mapping tokenmill, tokenmill.flows and tokenmill.tasks to
  this checkout), and it is what would otherwise answer `import tokenmill`;
- `-P`: neither the current directory nor a script's folder goes on sys.path, and the
  interpreter starts in an empty folder outside the repository anyway;
- PYTHONPATH = the install folder first, then the venv's site-packages (plain folders, for the
  dependencies: Prefect, pyarrow, ...), so the wheel's own tokenmill is the one found.

The child reports where every module came from, so the test checks the imports came from the
installed wheel and that no editable finder was on sys.meta_path, rather than trusting it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHECK = r"""
import importlib, json, sys
report = {"meta_path": [repr(finder) for finder in sys.meta_path], "sys_path": sys.path, "missing": {}, "found": {}}
for name in ("flows", "tasks", "flows.batch", "tasks.shards"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        report["missing"][name] = error.name
for name in ("tokenmill", "tokenmill.flows", "tokenmill.flows.batch", "tokenmill.tasks", "tokenmill.tasks.shards",
             "tokenmill.cli"):
    report["found"][name] = importlib.import_module(name).__file__
print(json.dumps(report))
"""


def _build_wheel(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ("tokenmill", "flows", "tasks"):
        shutil.copytree(REPO / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "--quiet", "-w", str(wheels), str(source)], check=True, cwd=tmp_path, timeout=300)
    (wheel,) = wheels.glob("tokenmill-*.whl")
    return wheel


def test_the_wheel_installs_tokenmill_flows_and_tasks_and_no_top_level_flows_or_tasks(tmp_path):
    wheel = _build_wheel(tmp_path)

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/RECORD"))
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        top_level = archive.read(f"{info}/top_level.txt").decode().split()
    assert {"tokenmill/flows/batch.py", "tokenmill/tasks/shards.py", "tokenmill/cli.py"} <= set(names)
    assert {name.split("/")[0] for name in names} == {"tokenmill", info}, "nothing but tokenmill/ and its metadata"
    assert top_level == ["tokenmill"]
    assert "[console_scripts]" in entry_points
    assert "tokenmill = tokenmill.cli:command" in entry_points.splitlines()

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                    "--target", str(site), str(wheel)], check=True, cwd=tmp_path, timeout=300)
    assert not (site / "flows").exists() and not (site / "tasks").exists()

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    dependencies = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), *dependencies]), HF_HUB_OFFLINE="1",
               PREFECT_HOME=str(tmp_path / "prefect"))
    done = subprocess.run([sys.executable, "-S", "-P", "-c", CHECK], cwd=outside, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])

    assert not [f for f in report["meta_path"] if "editable" in f.lower()], report["meta_path"]
    assert not [p for p in report["sys_path"] if p in ("", ".") or Path(p).resolve() == REPO], report["sys_path"]
    assert report["missing"] == {"flows": "flows", "tasks": "tasks", "flows.batch": "flows",
                                 "tasks.shards": "tasks"}
    for name, file in report["found"].items():
        assert Path(file).resolve().is_relative_to(site.resolve()), f"{name} came from {file}, not the wheel"
