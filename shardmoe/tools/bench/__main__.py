"""`python -m shardmoe.tools.bench`: the same run as `shardmoe bench`."""
import sys

from shardmoe.tools.bench import main

sys.exit(main())
