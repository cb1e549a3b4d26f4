"""``python -m opengem ...`` (and ``torchrun -m opengem ...``): the ``opengem`` command."""

from opengem.cli.main import main

raise SystemExit(main())
