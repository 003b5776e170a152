"""Run a quick selection of the tests under Python 3.12 and the newest jax that the pins allow.

    python scripts/newest_jax.py                    # create or update .venv-newest-jax, run
    python scripts/newest_jax.py --no-install       # reuse the venv as it is (no network)
    python scripts/newest_jax.py --venv DIR --no-tpu

jax releases after 0.10.2 need Python >= 3.12, so the project's usual Python 3.11 environment
never sees them. This script keeps a second environment, a Python 3.12 venv (``--venv``,
default ``.venv-newest-jax`` in the repository), installs jaxpar into it in editable mode with
the ``test`` and ``tpu`` extras, upgrading every dependency to the newest version that
``pyproject.toml`` allows (``pip install --upgrade --upgrade-strategy eager``), and runs a fixed
selection: the compile-free unit tests, a few equivalence tests (layouts, a pipeline, experts,
context attention against one device) and, when libtpu installed, the TPU-compile canaries and
memory checks. A jax, flax or libtpu release that breaks jaxpar shows up here first.

Python 3.12 is found as ``$PYTHON312``, else ``python3.12`` on PATH, else pyenv's newest 3.12
(``$PYENV_ROOT``, default ``~/.pyenv``). The versions tested and the result are printed last;
the exit code is pytest's (0: all passed), 2 when no Python 3.12 exists, 3 when the install
fails. About 5 minutes on 2 cores once installed (the first install downloads ~1 GB with
libtpu).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The quick selection, in order; each entry is a pytest argument (a file or a node id).
COMPILE_FREE = ["tests/unit"]  # the tier that compiles no model
EQ = "tests/equivalence"
LAYOUTS = f"{EQ}/test_parallel_layouts.py::test_layout_matches_single_device_loss_grads_and_params"
PIPELINE = f"{EQ}/test_pipeline.py::test_pipeline_matches_single_device_loss_grads_and_params"
EQUIVALENCE = [
    f"{EQ}/test_model.py::test_weight_gradients_are_their_own_matmul_equal_to_autodiffs",
    f"{LAYOUTS}[fsdp=8]",
    f"{LAYOUTS}[data=2,context=2,tensor=2]",
    f"{PIPELINE}[1f1b,pipe=2,fsdp=2,context=2,dots]",
    f"{EQ}/test_moe.py::test_dropless_layer_matches_naive_per_token_reference",
    f"{EQ}/test_moe.py::test_expert_parallel_layout_matches_single_device[data=2,expert=2,tensor=2]",
    f"{EQ}/test_context.py::test_ring_attention_under_remat_matches_the_single_device_run[dots]",
]
TPU = "tests/integration/test_tpu_target.py::test_"
TPU_TARGET = [  # left out with --no-tpu (without libtpu they skip)
    f"{TPU}compiles_for_the_eight_chips_of_the_slice",
    f"{TPU}fsdp_gathers_weights_and_reduce_scatters_grads_over_fsdp",
    f"{TPU}libtpu_still_aborts_on_the_expert_dispatch_nested_in_a_pipeline_stage",
    f"{TPU}libtpu_still_fails_on_a_ragged_all_to_all_in_a_pipeline_stage",
    f"{TPU}zero1_peak_memory_is_the_plans_for_tpu[data=8]",
    f"{TPU}splash_attention_compiles_for_tpu_without_a_sequence_square",
]
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "libtpu", "numpy", "grain")


def python_version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    major, minor = out.stdout.split()
    return int(major), int(minor)


def find_python312() -> tuple[str | None, list[str]]:
    """(the interpreter, or None; what was looked at, for the error)."""
    looked = []
    candidates = []
    if os.environ.get("PYTHON312"):
        candidates.append(("$PYTHON312", os.environ["PYTHON312"]))
    else:
        looked.append("$PYTHON312 (not set)")
    on_path = shutil.which("python3.12")
    if on_path:
        candidates.append(("PATH", on_path))
    else:
        looked.append("python3.12 on PATH (none)")
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = glob.glob(os.path.join(pyenv_root, "versions", "3.12*", "bin", "python3.12"))
    found.sort(key=lambda p: [int(x) if x.isdigit() else 0
                              for x in Path(p).parent.parent.name.split(".")])
    if found:
        candidates += [("pyenv", p) for p in reversed(found)]
    else:
        looked.append(f"{pyenv_root}/versions/3.12*/bin/python3.12 (none)")
    for where, python in candidates:
        if python_version(python) == (3, 12):
            return python, looked
        looked.append(f"{python} ({where}: not a working Python 3.12)")
        if where == "$PYTHON312":  # asked for explicitly: do not silently take another
            return None, looked
    return None, looked


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def make_venv(python312: str, venv: Path) -> None:
    if venv_python(venv).exists() and python_version(str(venv_python(venv))) == (3, 12):
        print(f"reusing {venv}", flush=True)
        return
    if venv.exists():
        raise SystemExit(f"{venv} exists but is not a Python 3.12 venv: remove it or pass --venv")
    print(f"creating {venv} with {python312}", flush=True)
    subprocess.run([python312, "-m", "venv", str(venv)], check=True)


def install(venv: Path, tpu: bool) -> int:
    extras = "test,tpu" if tpu else "test"
    pip = [str(venv_python(venv)), "-m", "pip"]
    print(f"installing jaxpar[{extras}] with the newest dependencies the pins allow", flush=True)
    steps = [[*pip, "install", "-q", "--upgrade", "pip"],
             [*pip, "install", "-q", "--upgrade", "--upgrade-strategy", "eager", "-e",
              f"{ROOT}[{extras}]"]]
    for step in steps:
        rc = subprocess.run(step, cwd=ROOT).returncode
        if rc != 0:
            return rc
    return 0


def versions(venv: Path) -> dict[str, str]:
    code = ("import json, sys; from importlib import metadata\n"
            "def v(name):\n"
            "    try: return metadata.version(name)\n"
            "    except metadata.PackageNotFoundError: return '-'\n"
            f"d = {{n: v(n) for n in {PACKAGES!r}}}\n"
            "d['python'] = '.'.join(map(str, sys.version_info[:3]))\n"
            "print(json.dumps(d))")
    out = subprocess.run([str(venv_python(venv)), "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "?"}
    return json.loads(out.stdout)


def version_line(found: dict[str, str]) -> str:
    return "  ".join(f"{k} {v}" for k, v in found.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-newest-jax",
                        help="the Python 3.12 venv to create or reuse (default: %(default)s)")
    parser.add_argument("--no-install", action="store_true",
                        help="reuse the venv as it is: no pip (it must exist)")
    parser.add_argument("--no-tpu", action="store_true",
                        help="leave out the tpu extra (libtpu) and the TPU-compile tests")
    parser.add_argument("--list", action="store_true", help="print the selection and exit")
    parser.add_argument("pytest_args", nargs="*",
                        help="more pytest arguments (after --), e.g. -- -x")
    args = parser.parse_args(argv)
    tpu = not args.no_tpu
    selection = [*COMPILE_FREE, *EQUIVALENCE, *(TPU_TARGET if tpu else [])]
    if args.list:
        print("\n".join(selection))
        return 0

    start = time.monotonic()
    venv = args.venv.resolve()
    if args.no_install:
        if not venv_python(venv).exists():
            print(f"newest_jax: --no-install, but there is no venv at {venv}", file=sys.stderr)
            return 2
    else:
        python312, looked = find_python312()
        if python312 is None:
            print("newest_jax: no Python 3.12 interpreter found; looked at:\n  "
                  + "\n  ".join(looked)
                  + "\nSet PYTHON312=/path/to/python3.12 (e.g. `pyenv install 3.12`).",
                  file=sys.stderr)
            return 2
        make_venv(python312, venv)
        if install(venv, tpu) != 0:
            print("newest_jax: the install failed (above)", file=sys.stderr)
            return 3
    found = versions(venv)
    print(f"testing with {version_line(found)}", flush=True)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's jaxpar, whatever the venv was made from
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # its `jaxpar` script
    command = [str(venv_python(venv)), "-m", "pytest", "-q", "-p", "no:cacheprovider",
               *selection, *args.pytest_args]
    rc = subprocess.run(command, cwd=ROOT, env=env).returncode
    minutes = (time.monotonic() - start) / 60
    result = "PASSED" if rc == 0 else f"FAILED (pytest exit code {rc})"
    print(f"\nnewest jax: {result} in {minutes:.1f} min\n  {version_line(found)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
