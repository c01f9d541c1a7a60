"""Ray side: placement groups and the groups of actors that train and generate."""
