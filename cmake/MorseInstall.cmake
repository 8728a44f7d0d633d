# cmake --install rules and the .deb (CPack). The package holds the daemons,
# the netprobe, the systemd units with example environment files (the .deb's
# postinst copies them to /etc/morse when absent), example configs,
# make-certs.sh (as morse-make-certs) and the docs.
include(GNUInstallDirs)
install(TARGETS morse-server morse-worker morse-netprobe RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(PROGRAMS deploy/make-certs.sh DESTINATION ${CMAKE_INSTALL_BINDIR} RENAME morse-make-certs)
install(FILES deploy/systemd/morse-server@.service deploy/systemd/morse-worker@.service
        DESTINATION lib/systemd/system)
install(FILES deploy/systemd/server.env deploy/systemd/worker.env
        DESTINATION ${CMAKE_INSTALL_DATADIR}/morse/systemd)
install(FILES deploy/configs/digits_adam.textproto deploy/configs/digits_onebit_adam.textproto
        DESTINATION ${CMAKE_INSTALL_DATADIR}/morse/configs)
install(FILES README.md docs/config.md docs/operations.md docs/security.md docs/deploy.md
        DESTINATION ${CMAKE_INSTALL_DOCDIR})

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME morse)
set(CPACK_PACKAGE_VENDOR "Morse")
set(CPACK_PACKAGE_CONTACT "Morse developers <morse@example.invalid>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "Parameter server for 1-bit Adam over TCP: morse-server and morse-worker daemons")
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
# Runtime library dependencies from the binaries (dpkg-shlibdeps).
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "adduser")
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "openssl")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${PROJECT_SOURCE_DIR}/deploy/debian/postinst ${PROJECT_SOURCE_DIR}/deploy/debian/postrm)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
include(CPack)
