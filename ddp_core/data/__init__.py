"""What experiments' data modules share; a dataset's own files, classes and normalisation stay in the experiment."""
