"""What a run did, for people: the HTML report with its plots, and the experiment trackers (TensorBoard, MLflow)."""
