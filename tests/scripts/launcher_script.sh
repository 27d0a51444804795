#!/bin/bash
# torchrun's launcher test script for --no-python (PyTorch's test/distributed/launcher/bin/test_script.sh).
FILE="$1/$RANK"
echo "creating $FILE"
touch "$FILE"
