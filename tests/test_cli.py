"""The CLI stays light: --help and the install path import neither torch nor transformers, and the device side
never imports the workstation package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import sys
from click.testing import CliRunner
from orin.cli import cli
for args in (["--help"], ["plan", "--help"], ["quantize", "--help"], ["serve", "--help"], ["install-service", "--help"]):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, (args, result.output)
import orin.power.meter, orin.units, orin.components, orin.checkpoint.manifest, orin.contract, orin.audio_format
heavy = sorted(m for m in ("torch", "transformers", "numpy", "quantize", "gptqmodel") if m in sys.modules)
print(",".join(heavy) or "light")
"""


def test_help_and_light_modules_import_nothing_heavy():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "light", out.stdout + out.stderr


def test_device_side_never_imports_quantize():
    device_modules = ["memory.loader", "runtime.engine", "serve.app", "power.meter", "checkpoint.reader", "int4.linear",
                      "checks.smoke", "inputs.media", "memory.plan", "runtime.decode", "runtime.thinker",
                      "runtime.talker", "runtime.vocoder", "contract"]
    probe = ("import sys\n" + "".join(f"import orin.{m}\n" for m in device_modules)
             + "print('quantize' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr
    for path in (REPO / "orin").rglob("*.py"):
        text = path.read_text()
        if path.name == "cli.py":
            continue  # the quantize command imports it lazily, inside the command
        assert "from quantize" not in text and "import quantize" not in text, path.name


def test_no_module_of_orin_imports_transformers():
    """Importing every module of the device side (all of orin/, the devtools included: their transformers uses
    are inside the functions that need the HF reference) loads no transformers: JetPack 6's Python 3.10 cannot
    have the pinned release."""
    probe = ("import pkgutil, importlib, sys, orin\n"
             "for m in pkgutil.walk_packages(orin.__path__, 'orin.'):\n"
             "    try:\n"
             "        importlib.import_module(m.name)\n"
             "    except ImportError as exc:  # the Triton kernels, where Triton is not installed\n"
             "        if exc.name != 'triton':\n"
             "            raise\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'quantize', 'gptqmodel')))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
