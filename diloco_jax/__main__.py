import sys

from diloco_jax.cli import main

sys.exit(main())
