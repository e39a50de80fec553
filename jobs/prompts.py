"""`ray job submit --working-dir . -- python jobs/prompts.py ARGS`: same arguments as `dflash-ray prompts`."""

from _entry import run

if __name__ == "__main__":
    run("prompts")
