from bitrl.engine.cli import main

raise SystemExit(main())
