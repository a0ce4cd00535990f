from manyeyes.app.cli import main

main()
