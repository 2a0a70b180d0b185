from casque.cli.main import main

main()
