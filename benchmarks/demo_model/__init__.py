"""Training and evaluation of the shipped `demo` model: a small GDN hybrid that answers
document look-up questions (`The code of Name is 1234.` ... `Question: What is the code of Name?`)."""
