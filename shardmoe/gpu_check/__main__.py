"""`python -m shardmoe.gpu_check`: the old name of `python -m shardmoe.tools.gpu_check`, kept for one
release; it runs the same main with the same arguments."""
import sys

from shardmoe.tools.gpu_check import main

sys.exit(main())
