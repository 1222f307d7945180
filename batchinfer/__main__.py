from batchinfer.cli import main

main()
