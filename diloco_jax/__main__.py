import sys

from diloco_jax.lm.cli import main

sys.exit(main())
