"""The tests, a package: each module is named for its path (``tests.keras.test_model``), so no
test folder shadows a real package of the same name. tests/README.md says where a module's tests are.
"""
