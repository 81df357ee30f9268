"""The accelerator window: the paper-budget queue (``gpu_queue``) and the script that runs it
on a bare machine (``run.sh``)."""
