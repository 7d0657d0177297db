"""The help layout every ``metronome`` command shares: the description as written, each flag with its default."""

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass
