"""`python -m shardmoe.gpu_check`: see shardmoe/gpu_check/__init__.py and docs/gpu.md."""
import sys

from shardmoe.gpu_check import main

sys.exit(main())
