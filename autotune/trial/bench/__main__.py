import sys

from autotune.trial.bench import main

sys.exit(main())
