from fedmm.cli import main

main()
