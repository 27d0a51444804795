from rlaunch.cli import main

main()
