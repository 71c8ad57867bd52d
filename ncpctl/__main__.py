from ncpctl.cli.app import main

main()
