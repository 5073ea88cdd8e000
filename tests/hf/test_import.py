"""transformers is optional (the "hf" extra): without it `import shardmoe` and the layer still work,
and `import shardmoe.hf` fails with one line that names what is missing and how to install it."""
import subprocess
import sys

# run in a fresh interpreter where `import transformers` fails as it does when it is not installed
# (a None entry in sys.modules raises ModuleNotFoundError with name "transformers")
WITHOUT_TRANSFORMERS = """
import sys
sys.modules["transformers"] = None
import torch
import shardmoe
shardmoe.MoE(8, 16, 4, 2)(torch.randn(3, 8))
import shardmoe.hf
"""


def test_shardmoe_hf_without_transformers_says_how_to_install_it():
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRANSFORMERS], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: shardmoe.hf needs transformers>=5,<6, which is not installed: "
        "pip install 'shardmoe[hf]'")
    assert "During handling" not in result.stderr, result.stderr  # the message alone, no chained error
