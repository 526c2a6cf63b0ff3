"""Input pipelines (Grain over local files or TFDS array_record, no TensorFlow)."""
from posjax.data.images import (ImagePipeline, default_data_config, make_image_pipeline,
                                validate_data_config)

__all__ = ["ImagePipeline", "default_data_config", "make_image_pipeline",
           "validate_data_config"]
