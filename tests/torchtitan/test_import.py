"""torchtitan is optional (the "torchtitan" extra): without it `import shardmoe` and the layer still
work, and `import shardmoe.torchtitan` fails with one line that names what is missing and how to
install it."""
import subprocess
import sys

# run in a fresh interpreter where `import torchtitan` fails as it does when it is not installed
# (a None entry in sys.modules raises ModuleNotFoundError with name "torchtitan")
WITHOUT_TORCHTITAN = """
import sys
sys.modules["torchtitan"] = None
import torch
import shardmoe
shardmoe.MoE(8, 16, 4, 2)(torch.randn(3, 8))
import shardmoe.torchtitan
"""


def test_shardmoe_torchtitan_without_torchtitan_says_how_to_install_it():
    result = subprocess.run([sys.executable, "-c", WITHOUT_TORCHTITAN], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: shardmoe.torchtitan needs torchtitan>=0.3.0,<0.4, which is not installed: "
        "pip install 'shardmoe[torchtitan]'")
    assert "During handling" not in result.stderr, result.stderr  # the message alone, no chained error
