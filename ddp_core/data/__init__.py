"""What experiments' data modules share: a download once per filesystem, files read without running their code,
image pipelines and generated stand-ins. The dataset's own files, classes and normalisation stay in the experiment."""
