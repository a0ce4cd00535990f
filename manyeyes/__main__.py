from manyeyes.app.cli import main

raise SystemExit(main())
