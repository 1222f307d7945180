"""Building blocks of the GDN-hybrid decoder: mixers (GDN, gated attention), MLPs, rotary."""
