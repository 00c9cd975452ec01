"""Drafter training: data (grain), frozen-target features, anchors, loss, the jitted step, the loop."""
