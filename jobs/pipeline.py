"""`ray job submit --working-dir . -- python jobs/pipeline.py --config FILE`: every stage in order,
same arguments as `dflash-ray pipeline`."""

from _entry import run

if __name__ == "__main__":
    run("pipeline")
