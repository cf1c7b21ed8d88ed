"""What an experiment's data module shares: a download once per filesystem (``download``), files read without
running their code (``files``), image pipelines, pictures and generated stand-ins (``images``).

An experiment's own data module keeps what is its dataset's: the file names, their checksums and layout, the
classes and the normalisation (``experiments/cifar10_data.py`` is one).
"""
