"""Looking inside the model: probes that read what a forward pass computes (attention weights,
block outputs, positions) for the widgets that show them."""
