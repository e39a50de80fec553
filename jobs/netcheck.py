"""`ray job submit --working-dir . -- python jobs/netcheck.py ARGS`: same arguments as `dflash-ray netcheck`."""

from _entry import run

if __name__ == "__main__":
    run("netcheck")
