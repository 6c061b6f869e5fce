"""Ports of TensorFlow's distributed-training tutorials, run end to end (docs/from_tensorflow.md).

Each port is a script that reads like the tutorial with TensorFlow's names renamed; its test
runs it as a user would (one process, or a cluster through ``stratagem launch`` /
``sg.testing.run_local_cluster``) and checks the tutorial's outcome from the report it writes.
"""
