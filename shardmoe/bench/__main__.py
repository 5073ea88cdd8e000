"""`python -m shardmoe.bench`: the same run as `shardmoe bench`."""
import sys

from shardmoe.bench import main

sys.exit(main())
