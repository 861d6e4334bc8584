from arl_tangram.cli import main

raise SystemExit(main())
