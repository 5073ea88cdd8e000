"""`python -m shardmoe.tools.gpu_check`: see shardmoe/tools/gpu_check/__init__.py and docs/gpu.md."""
import sys

from shardmoe.tools.gpu_check import main

sys.exit(main())
