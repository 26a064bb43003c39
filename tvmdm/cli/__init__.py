"""The ``tvmdm`` command line: parses arguments and calls the stages."""
