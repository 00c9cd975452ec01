"""Pure layer functions shared by the target, MTP and DFlash modules."""
