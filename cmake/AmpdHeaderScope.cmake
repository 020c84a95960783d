# ampd_header_scope(): the headers a target lets its users include.
#
# Every #include in the project is written from the source root
# ("server/engine/api.h"), but no target puts the source root on an include
# path. Instead each target gets a folder of its own in the build tree,
#
#   ${CMAKE_BINARY_DIR}/scopes/<target>/<path>  ->  ${PROJECT_SOURCE_DIR}/<path>
#
# holding symbolic links to the folders and headers it owns, and that folder
# is the target's include directory. A translation unit therefore sees the
# headers of its own target and of the targets it links: PUBLIC (and
# INTERFACE) dependencies pass their scopes on to their dependents, PRIVATE
# ones do not. An #include across the layering names a file missing from
# every scope on the compile line and fails to build.
#
#   ampd_header_scope(<target> [PUBLIC|INTERFACE] <path>...
#                     [PRIVATE <path>...])
#
# <path> is a folder or a file relative to the source root, or a glob of
# files ("kernels/*.h": the top-level headers, not the subfolders). A folder
# brings in everything under it, subfolders included. Paths after PRIVATE
# are seen by the target's own sources only (scopes/<target>.private).
function(ampd_header_scope target)
  set(visibility PUBLIC)
  get_target_property(type ${target} TYPE)
  if(type STREQUAL "INTERFACE_LIBRARY")
    set(visibility INTERFACE)
  endif()
  set(public_paths)
  set(private_paths)
  set(current public)
  foreach(arg ${ARGN})
    if(arg STREQUAL "PUBLIC" OR arg STREQUAL "INTERFACE")
      set(current public)
    elseif(arg STREQUAL "PRIVATE")
      set(current private)
    else()
      list(APPEND ${current}_paths ${arg})
    endif()
  endforeach()
  if(public_paths)
    _ampd_scope_links(${CMAKE_BINARY_DIR}/scopes/${target} "${public_paths}")
    target_include_directories(${target} ${visibility} ${CMAKE_BINARY_DIR}/scopes/${target})
  endif()
  if(private_paths AND visibility STREQUAL "INTERFACE")
    message(FATAL_ERROR "ampd_header_scope: ${target} has no sources of its own to see PRIVATE paths")
  endif()
  if(private_paths)
    _ampd_scope_links(${CMAKE_BINARY_DIR}/scopes/${target}.private "${private_paths}")
    target_include_directories(${target} PRIVATE ${CMAKE_BINARY_DIR}/scopes/${target}.private)
  endif()
endfunction()

# Replaces <root> by one symbolic link per path (globs expanded here, and
# re-expanded at build time when a matching file appears or goes).
function(_ampd_scope_links root paths)
  file(REMOVE_RECURSE ${root})
  file(MAKE_DIRECTORY ${root})
  foreach(path ${paths})
    if(path MATCHES "[*?]")
      file(GLOB matches CONFIGURE_DEPENDS RELATIVE ${PROJECT_SOURCE_DIR}
           ${PROJECT_SOURCE_DIR}/${path})
      if(NOT matches)
        message(FATAL_ERROR "ampd_header_scope: ${path} matches no file")
      endif()
    elseif(EXISTS ${PROJECT_SOURCE_DIR}/${path})
      set(matches ${path})
    else()
      message(FATAL_ERROR "ampd_header_scope: ${PROJECT_SOURCE_DIR}/${path} does not exist")
    endif()
    foreach(match ${matches})
      get_filename_component(parent ${root}/${match} DIRECTORY)
      file(MAKE_DIRECTORY ${parent})
      file(CREATE_LINK ${PROJECT_SOURCE_DIR}/${match} ${root}/${match} SYMBOLIC)
    endforeach()
  endforeach()
endfunction()
