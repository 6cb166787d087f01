"""Command-line tools around the library (bench, heatmap, emulated link, cli): the library never imports them."""
