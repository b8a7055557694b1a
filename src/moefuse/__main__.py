from moefuse.cli import main

raise SystemExit(main())
