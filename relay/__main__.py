from relay.assembly.cli import main

raise SystemExit(main())
